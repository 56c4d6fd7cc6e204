"""Tell the on-call person, once: alert channels (SMTP e-mail, a Slack-compatible webhook, a command) and the
de-duplication state behind ``opskit status NAME --alert``.

The state (``<run>/watchdog/alerts.json``) remembers, per channel, which alert keys it was last told about and when:
a channel is sent the alert again only when the set of alerts changed or ``resend_hours`` passed, and a "resolved"
message once they all cleared. ``--ack`` silences the current set until it changes. A channel that fails keeps its
old state (the next run tries again) and never stops the others.

Settings come from the user's ``~/.config/opskit/alerts.yaml`` (``$OPSKIT_CONFIG``; the keys of ``watchdog.alerts``),
the spec's ``watchdog.alerts`` over it, and for cron the environment over both:
``OPSKIT_SMTP_HOST``, ``OPSKIT_SMTP_PORT``, ``OPSKIT_SMTP_USER``, ``OPSKIT_SMTP_PASSWORD`` (or the variable
``email.password_env`` names), ``OPSKIT_SMTP_SECURITY`` (none, starttls, ssl), ``OPSKIT_ALERT_EMAIL_TO``
(comma-separated), ``OPSKIT_ALERT_EMAIL_FROM``, ``OPSKIT_ALERT_WEBHOOK``, ``OPSKIT_ALERT_COMMAND``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import ValidationError

from opskit.errors import OpskitError
from opskit.fsutil import atomic_write_text, read_json
from opskit.logs.parse import from_end
from opskit.monitor.findings import Report
from opskit.run import chain
from opskit.run.paths import RunPaths
from opskit.spec.files import SpecError
from opskit.spec.schema import AlertsSpec

TIMEOUT_S = 30
_DEFAULT_PORTS = {"none": 25, "starttls": 587, "ssl": 465}


class AlertConfigError(OpskitError, ValueError):
    """Alert settings that cannot work (no channel, a bad port); one line naming the setting."""


class ChannelError(OpskitError, RuntimeError):
    """A channel could not deliver; one line, without secrets."""


@dataclass(frozen=True)
class Message:
    """What every channel sends. ``kind`` is ``alert`` or ``resolved``; ``findings`` as in ``Report.as_json``."""

    kind: str
    subject: str
    body: str
    findings: list[dict]


@dataclass(frozen=True)
class Email:
    host: str
    port: int
    security: str
    sender: str
    to: tuple[str, ...]
    user: str | None
    password: str | None = field(repr=False)
    name = "email"

    def send(self, message: Message) -> None:
        """Raises ChannelError: the server refused, timed out or is not there."""
        import smtplib  # smtplib, ssl, email: ~15 ms, only when an e-mail goes out
        import ssl
        from email.message import EmailMessage

        mail = EmailMessage()
        mail["From"], mail["To"], mail["Subject"] = self.sender, ", ".join(self.to), message.subject
        mail.set_content(message.body)
        try:
            if self.security == "ssl":
                smtp = smtplib.SMTP_SSL(self.host, self.port, timeout=TIMEOUT_S,
                                        context=ssl.create_default_context())
            else:
                smtp = smtplib.SMTP(self.host, self.port, timeout=TIMEOUT_S)
            with smtp:
                if self.security == "starttls":
                    smtp.starttls(context=ssl.create_default_context())
                if self.user:
                    smtp.login(self.user, self.password or "")
                smtp.send_message(mail)
        except (OSError, smtplib.SMTPException) as e:
            raise ChannelError(f"email via {self.host}:{self.port}: {type(e).__name__}: {e}") from None


@dataclass(frozen=True)
class Webhook:
    url: str
    name = "webhook"

    def send(self, message: Message) -> None:
        """POST ``{"text": subject + findings}`` (Slack's incoming-webhook format) plus ``opskit`` details.

        Raises ChannelError: no answer, or an HTTP status other than 2xx.
        """
        import urllib.error
        import urllib.request  # ~20 ms (http.client, email): only when a webhook is called

        text = message.subject + "\n" + "\n".join(f"[{f['severity']}] {f['message']}" for f in message.findings
                                                  if f["severity"] != "ok")
        payload = {"text": text, "opskit": {"kind": message.kind, "subject": message.subject,
                                            "findings": message.findings}}
        request = urllib.request.Request(self.url, data=json.dumps(payload).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as answer:
                answer.read()
        except (OSError, urllib.error.URLError) as e:  # HTTPError (4xx/5xx) is one of them
            raise ChannelError(f"webhook {_host_of(self.url)}: {e}") from None


def _host_of(url: str) -> str:
    """The URL without its path: Slack's webhook paths are secrets."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}/..."


@dataclass(frozen=True)
class Command:
    command: str
    name = "command"

    def send(self, message: Message) -> None:
        """Run the command (``sh -c``) with the body on stdin, ``OPSKIT_ALERT_SUBJECT`` and ``OPSKIT_ALERT_KIND``.

        Raises ChannelError: it failed, or ran longer than TIMEOUT_S.
        """
        env = {**os.environ, "OPSKIT_ALERT_SUBJECT": message.subject, "OPSKIT_ALERT_KIND": message.kind}
        try:
            done = subprocess.run(self.command, shell=True, input=message.body, text=True, capture_output=True,
                                  env=env, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise ChannelError(f"command: no exit within {TIMEOUT_S} s") from None
        if done.returncode:
            last = (done.stderr.strip().splitlines() or [""])[-1]
            raise ChannelError(f"command exited {done.returncode}: {last}".rstrip(": "))


def user_config(environ: Mapping[str, str] | None = None) -> Path:
    """Where the user's alert settings live: ``$OPSKIT_CONFIG``, else ``$XDG_CONFIG_HOME/opskit/alerts.yaml``."""
    env = os.environ if environ is None else environ
    if env.get("OPSKIT_CONFIG"):
        return Path(env["OPSKIT_CONFIG"])
    return Path(env.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "opskit" / "alerts.yaml"


def settings(spec_alerts: AlertsSpec, environ: Mapping[str, str] | None = None) -> AlertsSpec:
    """The spec's alert settings (only the keys it sets) over the user's file, if there is one.

    Raises:
        AlertConfigError: the file is not YAML, or not ``watchdog.alerts`` keys; one line naming it.
    """
    from opskit.spec.load import deep_merge, read_yaml  # yaml: only when the settings are read

    path = user_config(environ)
    if not path.is_file():
        return spec_alerts
    try:
        raw = read_yaml(path) or {}
    except SpecError as e:
        raise AlertConfigError(str(e)) from None
    if not isinstance(raw, dict):
        raise AlertConfigError(f"{path}: expected the keys of a spec's watchdog.alerts (email, webhook, ...)")
    try:
        return AlertsSpec.model_validate(deep_merge(raw, spec_alerts.model_dump(exclude_unset=True)))
    except ValidationError as e:
        raise AlertConfigError(f"{path}: " + "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}"
                                                       for err in e.errors())) from None


def channels(config: AlertsSpec, environ: Mapping[str, str] | None = None) -> list:
    """The channels configured by the spec and the environment (the environment wins).

    Raises:
        AlertConfigError: a malformed environment setting.
    """
    env = os.environ if environ is None else environ
    email = config.email
    found: list = []
    to = env.get("OPSKIT_ALERT_EMAIL_TO")
    recipients = tuple(a.strip() for a in to.split(",") if a.strip()) if to else tuple(email.to)
    if recipients:
        security = env.get("OPSKIT_SMTP_SECURITY", email.security)
        if security not in _DEFAULT_PORTS:
            raise AlertConfigError(f"OPSKIT_SMTP_SECURITY={security}: expected none, starttls or ssl")
        port_text = env.get("OPSKIT_SMTP_PORT")
        if port_text is not None and not port_text.isdigit():
            raise AlertConfigError(f"OPSKIT_SMTP_PORT={port_text}: expected a port number")
        port = int(port_text) if port_text else email.port or _DEFAULT_PORTS[security]
        password_env = "OPSKIT_SMTP_PASSWORD" if "OPSKIT_SMTP_PASSWORD" in env else email.password_env
        found.append(Email(env.get("OPSKIT_SMTP_HOST", email.host), port, security,
                           env.get("OPSKIT_ALERT_EMAIL_FROM", email.sender), recipients,
                           env.get("OPSKIT_SMTP_USER", email.user), env.get(password_env)))
    if url := env.get("OPSKIT_ALERT_WEBHOOK", config.webhook):
        if not url.startswith(("http://", "https://")):
            raise AlertConfigError("OPSKIT_ALERT_WEBHOOK: expected an http:// or https:// URL")
        found.append(Webhook(url))
    if command := env.get("OPSKIT_ALERT_COMMAND", config.command):
        found.append(Command(command))
    return found


# --------------------------------------------------------------------------- messages


def compose(report: Report, kind: str, cleared: list[str], config: AlertsSpec, cli_name: str) -> Message:
    """The subject and body: findings, what cleared since the last message, the log's last lines, the runbook."""
    alerts = report.alerts
    if kind == "alert":
        more = f" (+{len(alerts) - 1} more)" if len(alerts) > 1 else ""
        subject = f"[ALERT] {report.name}: {_headline(alerts[0].message)}{more}" if alerts else f"[ALERT] {report.name}"
        head = f"***ALERT: {report.name}: {len(alerts)} alert(s) at {report.time:%Y-%m-%d %H:%M:%S}***"
    else:
        subject = f"[RESOLVED] {report.name}: all clear ({', '.join(cleared)})"
        head = f"RESOLVED: {report.name} has no alert left at {report.time:%Y-%m-%d %H:%M:%S}"
    lines = [head, "", "Findings:"]
    lines += [f"  [{f.severity}] {f.key}: {f.message}" for f in report.findings]
    if cleared:
        lines += ["", "Cleared since the last message: " + ", ".join(cleared)]
    if report.pulse_lines:
        lines += ["", *report.pulse_lines]
    if config.log_lines and report.main_log and report.main_log.is_file():
        lines += ["", f"Last lines of {report.main_log}:", *("  " + x for x in _tail(report.main_log,
                                                                                    config.log_lines))]
    lines += ["", "Runbook:", *("  " + link for link in config.runbook),
              "  docs/operations.md in opskit: what each finding means and what to do"]
    if kind == "alert":
        lines += ["", f"`opskit status {cli_name} --ack` silences this alert until something changes."]
    return Message(kind, subject, "\n".join(lines) + "\n",
                   [{"key": f.key, "severity": f.severity, "message": f.message} for f in report.findings])


def _headline(message: str) -> str:
    """A finding's message up to its details (`` (...)``, ``; ...``, ``: `command` ``), for subjects."""
    return re.split(r" \(|; |: `", message, maxsplit=1)[0][:150]


def _tail(path: Path, count: int) -> list[str]:
    lines: list[str] = []

    def take(text: str, at_start: bool) -> bool:
        nonlocal lines
        lines = (text.splitlines() + lines)[-count:]  # blocks end at a newline: split each, keep count at most
        return len(lines) >= count

    from_end(path, take)
    return lines


# --------------------------------------------------------------------------- de-duplication


@dataclass
class Outcome:
    """What :func:`notify` did: ``sent`` (channel, kind) pairs, ``failures`` one line each, ``silenced`` by --ack."""

    sent: list[tuple[str, str]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    silenced: bool = False
    acked: bool = False

    def as_json(self) -> dict:
        return {"sent": [{"channel": c, "kind": k} for c, k in self.sent], "failures": self.failures,
                "silenced": self.silenced, "acked": self.acked}


def _load(run: RunPaths) -> dict:
    try:
        state = read_json(run.alerts_state)
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def _active(report: Report, previous: dict) -> dict[str, str]:
    """Alert key -> message now; alerts on checks that could not run this time (``report.unknown``) are kept."""
    active = {f.key: f.message for f in report.alerts}
    for key, message in previous.items():
        if key.startswith(report.unknown) and report.unknown and key not in active:
            active[key] = message
    return active


def notify(report: Report, config: AlertsSpec, run: RunPaths, cli_name: str, ack: bool = False,
           environ: Mapping[str, str] | None = None) -> Outcome:
    """Send what each channel has not been told yet; with ``ack``, silence the current alerts instead.

    Raises:
        AlertConfigError: no channel configured (and not ``ack``), or a malformed setting. OutputRefusedError:
            ``paths.output`` is no run directory to keep the alert state in (after the messages went out).
    """
    config = settings(config, environ)
    state = _load(run)
    active = _active(report, state.get("active", {}))
    outcome = Outcome()
    acked = state.get("acked")
    if acked is not None and set(acked) != set(active):
        acked = None  # something changed: the silence is over
    if ack:
        acked, outcome.acked = sorted(active), True
    else:
        found = channels(config, environ)
        if not found:
            raise AlertConfigError("no alert channel: set watchdog.alerts.email.to, .webhook or .command in the spec "
                                   f"or in {user_config(environ)}, or OPSKIT_ALERT_EMAIL_TO / OPSKIT_ALERT_WEBHOOK / "
                                   "OPSKIT_ALERT_COMMAND")
        now = report.time.timestamp()
        sent_state = state.setdefault("channels", {})
        for channel in found:
            told = sent_state.get(channel.name, {"keys": [], "at": 0})
            kind, cleared = _due(active, told, now, config.resend_hours * 3600, acked is not None)
            outcome.silenced |= acked is not None and bool(active)
            if kind is None:
                continue
            try:
                channel.send(compose(report, kind, cleared, config, cli_name))
            except ChannelError as e:
                outcome.failures.append(str(e))
                continue
            sent_state[channel.name] = {"keys": sorted(active), "at": now}
            outcome.sent.append((channel.name, kind))
    state.update(active=active, acked=acked)
    # even before the first submission (an absent job alerts): the run directory is created, marked as opskit's
    chain.claim_state_dir(run, run.watchdog_dir, "status --alert")
    atomic_write_text(run.alerts_state, json.dumps(state, indent=1))
    return outcome


def _due(active: dict[str, str], told: dict, now: float, resend_s: float,
         silenced: bool) -> tuple[str | None, list[str]]:
    """(``alert``, ``resolved`` or None, keys cleared since the channel's last message)."""
    before = set(told["keys"])
    cleared = sorted(before - set(active))
    if not active:
        return ("resolved" if before else None), cleared
    if silenced:
        return None, cleared
    if set(active) != before or now - told["at"] >= resend_s:
        return "alert", cleared
    return None, cleared
