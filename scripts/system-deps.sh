#!/usr/bin/env bash
# Debian packages opskit's demo and tests use: SLURM + munge (local cluster), bible-kjv (the demo corpus),
# ShellCheck for the rendered-script checks, g++ (DeepSpeed's CPU communication op compiles once on first use),
# cron (crontab, for `opskit cron`'s crontab path), openssl (a self-signed certificate for the SMTP TLS tests),
# chromium (the tests open `opskit report`'s page in it, headless, through Playwright).
set -euo pipefail
packages=(slurm-wlm munge bible-kjv shellcheck g++ cron openssl chromium)
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
    echo "system-deps: not root or no apt-get, skipping ${missing[*]} (the demo falls back to the local executor)"
    exit 0
fi
echo "system-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq "${missing[@]}" >/dev/null
