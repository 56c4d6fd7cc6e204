"""The typer command line: thin modules that parse, call one library function and render with rich."""
