"""Bundled training specs (YAML); see opskit.spec.load."""
