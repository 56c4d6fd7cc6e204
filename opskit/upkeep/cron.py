"""``opskit cron``: the hourly watchdog and sync of a run, from the user's crontab or, on clusters without one (Jean
Zay), from a self-resubmitting SLURM job on a CPU partition.

The SLURM job is BigScience's ``cron-hourly.slurm`` (reference 1.4): it resubmits itself first with
``sbatch --begin=now+1hour`` (so a failing hourly step never ends the cron), then runs the hourly commands, without
``set -e`` ("we must run all of it"). Unlike BigScience's, ``opskit cron status`` notices when the cron job itself is
gone. ``install`` records what it added in ``<run>/cron/cron.json``; ``uninstall`` removes exactly that. The cron
job is found by its run (``#SBATCH --comment=opskit-cron:<run directory>``, :func:`opskit.run.chain.run_jobs`), so
two runs of one spec name keep their own cron jobs. Neither replaces nor removes what it did not write: a
``cron/cron.slurm`` opskit did not render, a crontab line it did not add.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timedelta
from pathlib import Path

from opskit.errors import OpskitError
from opskit.fsutil import atomic_write_text, claim_file, read_json
from opskit.monitor.alerts import AlertConfigError, settings
from opskit.run import chain
from opskit.run.paths import RunPaths
from opskit.slurm import client
from opskit.spec.schema import Spec
from opskit.submission.render import template_env

METHODS = ("crontab", "slurm")
CRON_TIME = "0:30:00"  # the SLURM cron job's time limit (BigScience's cron-hourly.slurm)


class CronError(OpskitError, RuntimeError):
    """Cron cannot be installed or removed (no crontab, already installed, crontab refused); one line."""


@dataclass(frozen=True)
class Installed:
    """What ``install`` added (``<run>/cron/cron.json``)."""

    method: str
    installed: str
    commands: list[str]
    crontab_line: str | None = None
    job_name: str | None = None
    script: str | None = None
    job_ids: list[str] = field(default_factory=list)

    def as_json(self) -> dict:
        """``opskit cron install --json``: ``{"dry_run": false, "installed": <this record>}``."""
        return {"dry_run": False, "installed": asdict(self)}


@dataclass(frozen=True)
class CronPlan:
    """What ``install`` would add (``opskit cron install --dry-run`` prints it)."""

    installed: Installed
    """The record ``install`` writes (no job ids before sbatch)."""
    script: str | None = None
    """slurm: the rendered job script."""
    command: list[str] = field(default_factory=list)
    """slurm: the sbatch command."""

    def as_json(self) -> dict:
        """``opskit cron install --dry-run --json``: the record install would write (no job ids), the script and
        the sbatch command (slurm; None and [] for crontab)."""
        return {"dry_run": True, "installed": asdict(self.installed), "script": self.script, "command": self.command}


@dataclass(frozen=True)
class CronStatus:
    """What ``opskit cron status`` prints."""

    installed: Installed | None
    ok: bool
    """False when install's cron line or SLURM job is gone (the hourly checks no longer run)."""
    lines: list[str]

    def as_json(self) -> dict:
        return {"installed": asdict(self.installed) if self.installed else None, "ok": self.ok,
                "lines": self.lines}


def read_installed(run: RunPaths) -> Installed | None:
    """The record of ``install``, or None when cron is not installed for the run.

    Raises:
        CronError: a record that is not opskit's.
    """
    path = run.cron_record
    if not path.exists() and not path.is_symlink():
        return None
    try:
        return Installed(**read_json(path))
    except (OSError, ValueError, TypeError) as e:
        raise CronError(f"{path}: not opskit's cron record ({e}); remove it by hand") from None


def hourly_commands(spec: Spec, sync_to: str | None, python: str = sys.executable) -> list[str]:
    """The hourly shell commands: the watchdog (``opskit status``: PULSE or ALERT lines; ``--alert`` when the spec
    or the user's alerts.yaml names an alert channel, else ``--page``: either refreshes the run's page) and, with
    ``sync_to`` or the spec's ``sync.targets``, the sync of logs (the page with them), TensorBoard and CodeCarbon; run
    from the current directory (where ``trainings/`` is found)."""
    opskit = f"{shlex.quote(python)} -m opskit.cli.app"
    name = shlex.quote(spec.cli_name)
    try:
        alerts = settings(spec.watchdog.alerts)
        alert = bool(alerts.email.to or alerts.webhook or alerts.command)
    except AlertConfigError:
        alert = True  # then `opskit status --alert` names the broken file every hour
    commands = [f"{opskit} status {name} " + ("--alert" if alert else "--page")]
    if sync_to:
        commands.append(f"{opskit} sync all {name} --to {shlex.quote(sync_to)}")
    elif spec.sync.targets:
        commands.append(f"{opskit} sync all {name}")
    return commands


def cron_job_name(spec: Spec) -> str:
    """The SLURM job name of a spec's cron job (the training's name + ``-cron``)."""
    return f"{spec.job_name}-cron"


def _environment() -> str:
    """``cd`` and ``PYTHONPATH`` of the installing shell: cron and a later SLURM job start from neither."""
    prefix = f"cd {shlex.quote(os.getcwd())} && "
    if os.environ.get("PYTHONPATH"):
        prefix += f"export PYTHONPATH={shlex.quote(os.environ['PYTHONPATH'])} && "
    return prefix


def pick_method(method: str | None) -> str:
    """``crontab`` where the command exists, else ``slurm``; an explicit choice is checked.

    Raises:
        CronError: an unknown method, or ``crontab`` asked for where there is none.
    """
    if method is None:
        return "crontab" if shutil.which("crontab") else "slurm"
    if method not in METHODS:
        raise CronError(f"--via {method}: expected crontab or slurm")
    if method == "crontab" and not shutil.which("crontab"):
        raise CronError("--via crontab: no crontab command here; use --via slurm (a self-resubmitting job)")
    return method


def plan_install(spec: Spec, sync_to: str | None = None, method: str | None = None,
                 now: datetime | None = None) -> CronPlan:
    """What :func:`install` would add, with every check it makes; nothing is written or submitted.

    Raises:
        CronError: already installed (uninstall first), a crontab line of this run without a record, no way to
            install. ``OutputRefusedError``: the run directory or ``cron/cron.slurm`` is not opskit's.
    """
    run = RunPaths.of(spec)
    if (old := read_installed(run)) is not None:
        raise CronError(f"cron is already installed for {spec.job_name} ({old.method}, {old.installed}): "
                        f"`opskit cron uninstall {shlex.quote(spec.cli_name)}` first")
    method = pick_method(method)
    chain.claim_run_dir(run, "cron install", write=False)
    now = now or datetime.now()
    stamp = f"{now:%Y-%m-%d %H:%M:%S}"
    commands = hourly_commands(spec, sync_to)
    if method == "crontab":
        # One line, tagged with the run directory; `%` is a newline to cron unless escaped.
        tag = _crontab_tag(run)
        if any(line.endswith(tag) for line in _read_crontab()):
            raise CronError(f"the crontab already has a line of this run ('{tag}') but there is no record "
                            f"{run.cron_record}: remove that line (crontab -e), then install again")
        log = shlex.quote(str(run.cron_log))
        body = _environment() + "; ".join(f"{c} >> {log} 2>&1" for c in commands)
        line = f"{now.minute} * * * * {body.replace('%', chr(92) + '%')} {tag}"
        return CronPlan(Installed("crontab", stamp, commands, crontab_line=line))
    script = run.cron_script
    claim_file(script, force=True, ours=chain.rendered_by_opskit, flag="paths.output")
    return CronPlan(Installed("slurm", stamp, commands, job_name=cron_job_name(spec), script=str(script)),
                    render_cron_script(spec, run, commands, script), client.sbatch_command(script))


def install(spec: Spec, sync_to: str | None = None, method: str | None = None,
            now: datetime | None = None) -> Installed:
    """Set up the hourly commands of a run (:func:`plan_install`, then add the crontab line or write the job script
    and submit it), and record what was added.

    Raises:
        CronError, ``OutputRefusedError``: see :func:`plan_install`. ``SlurmError`` from sbatch.
    """
    plan = plan_install(spec, sync_to, method, now)
    run = RunPaths.of(spec)
    chain.claim_run_dir(run, "cron install")
    run.cron_dir.mkdir(parents=True, exist_ok=True)
    installed = plan.installed
    if installed.method == "crontab":
        _write_crontab(_read_crontab() + [installed.crontab_line])
    else:
        script = Path(installed.script)
        atomic_write_text(script, plan.script, mode=0o755)
        installed = replace(installed, job_ids=[client.sbatch(script)])
    atomic_write_text(run.cron_record, json.dumps(asdict(installed), indent=2) + "\n")
    return installed


def _crontab_tag(run: RunPaths) -> str:
    """The comment that ends the crontab line of a run (the run directory's hash)."""
    return f"# opskit cron {hashlib.sha1(str(run.root).encode()).hexdigest()[:12]}"


def render_cron_script(spec: Spec, run: RunPaths, commands: list[str], script: Path) -> str:
    """The self-resubmitting SLURM job (``opskit/slurm/templates/cron.slurm``); its comment names the run, and each
    resubmission reads it again from the header."""
    s = spec.slurm
    sbatch = {"job-name": cron_job_name(spec), "comment": chain.job_comment(run, "cron"),
              "partition": s.cron_partition, "account": s.cron_account or s.account, "nodes": 1, "ntasks": 1,
              "time": CRON_TIME, "output": run.cron_output}
    return template_env().get_template("cron.slurm").render(
        sbatch={k: v for k, v in sbatch.items() if v is not None}, spec=spec, script=script,
        cd=os.getcwd(), pythonpath=os.environ.get("PYTHONPATH"), commands=commands)


def status(spec: Spec, now: datetime | None = None) -> CronStatus:
    """Is the cron installed, when does it run next, and is it still there?

    Raises:
        ``SchedulerUnreachable`` for a SLURM cron when squeue does not answer.
    """
    run = RunPaths.of(spec)
    installed = read_installed(run)
    name = shlex.quote(spec.cli_name)
    if installed is None:
        return CronStatus(None, True, [f"cron: not installed for {spec.job_name} (`opskit cron install {name}`)"])
    now = now or datetime.now()
    lines = [f"cron: installed {installed.installed} via {installed.method}; hourly: {'; '.join(installed.commands)}",
             f"cron: output in {run.cron_log if installed.method == 'crontab' else run.cron_dir}"]
    if installed.method == "crontab":
        present = installed.crontab_line in _read_crontab()
        if present:
            minute = int(installed.crontab_line.split(" ", 1)[0])
            upcoming = now.replace(minute=minute, second=0, microsecond=0)
            upcoming += timedelta(hours=1) if upcoming <= now else timedelta()
            lines.append(f"cron: next run at {upcoming:%Y-%m-%d %H:%M} (crontab, minute {minute} of every hour)")
    else:
        jobs = chain.run_jobs(run, installed.job_name, client.squeue(), "cron")
        present = bool(jobs)
        for job in jobs:
            when = (f"running now since {job.start_time}" if job.state == "RUNNING"
                    else f"next run at {job.start_time.replace('T', ' ')}")
            lines.append(f"cron: {when} (job {job.job_id}, {job.state.lower()} {job.reason})")
    if not present:
        lines.append(f"cron: WARNING: the {installed.method} cron of {spec.job_name} is gone, so the hourly checks "
                     f"no longer run: `opskit cron uninstall {name}` then `opskit cron install {name}`")
    return CronStatus(installed, present, lines)


def uninstall(spec: Spec, dry_run: bool = False) -> list[str]:
    """Remove what ``install`` added (with ``dry_run``, nothing); returns what was (or would be) removed: the
    crontab line (one copy, if a user copied it), or the job script (when opskit rendered it) and the run's cron
    jobs; then the record.

    Raises:
        CronError: not installed. ``SlurmError`` from squeue / scancel.
    """
    run = RunPaths.of(spec)
    installed = read_installed(run)
    if installed is None:
        raise CronError(f"cron is not installed for {spec.job_name} (no {run.cron_record})")
    removed = []
    if installed.method == "crontab":
        lines = _read_crontab()
        if installed.crontab_line in lines:
            last = len(lines) - 1 - lines[::-1].index(installed.crontab_line)
            if not dry_run:
                _write_crontab(lines[:last] + lines[last + 1:])
            removed.append(f"crontab line: {installed.crontab_line}")
    else:
        # The script first: a running cron job resubmits itself only while its script exists.
        script = Path(installed.script)
        if chain.rendered_by_opskit(script):
            if not dry_run:
                script.unlink()
            removed.append(f"script {installed.script}")
        ids = sorted({e.array_id for e in chain.run_jobs(run, installed.job_name, client.squeue(), "cron")}, key=int)
        if ids:
            if not dry_run:
                client.scancel(ids)
            removed.append(f"SLURM job(s) {', '.join(ids)} ({installed.job_name})")
    if not dry_run:
        run.cron_record.unlink()
    removed.append(f"record {run.cron_record}")
    return removed


def _read_crontab() -> list[str]:
    done = subprocess.run(["crontab", "-l"], capture_output=True, text=True, timeout=20)
    if done.returncode != 0:
        if "no crontab" in done.stderr:
            return []
        raise CronError(f"crontab -l: {' '.join(done.stderr.split()) or f'exit code {done.returncode}'}")
    return done.stdout.splitlines()


def _write_crontab(lines: list[str]) -> None:
    text = "".join(line + "\n" for line in lines)
    done = subprocess.run(["crontab", "-"], input=text, capture_output=True, text=True, timeout=20)
    if done.returncode != 0:
        raise CronError(f"crontab -: {' '.join(done.stderr.split()) or f'exit code {done.returncode}'}")
