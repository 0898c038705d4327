"""`kvstore health` and `kvstore completion`: what etcdctl's `endpoint health` and shell
completion give, for the base install (grpcio only).

`health` asks each endpoint the standard gRPC health service (`grpc.health.v1.Health/Check`,
service "": the node serves) itself; the two tiny messages are encoded here, so that the client
needs neither grpcio-health-checking nor any server package. `completion` prints a script for
bash, zsh or fish, generated from the command line's own parser, so it never falls behind a new
command or option.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from kvstore.client import ClientSecurity
from kvstore.output import EXIT_ERROR, EXIT_OK, EXIT_UNREACHABLE, Printer, format_table, one_line

HEALTH_CHECK = "/grpc.health.v1.Health/Check"
# HealthCheckResponse.ServingStatus (grpc/health/v1/health.proto)
STATUSES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


@dataclass(frozen=True, slots=True)
class Health:
    endpoint: str
    status: str  # SERVING, NOT_SERVING, ... or UNREACHABLE / ERROR
    took_ms: float
    error: str = ""


def serving_status(raw: bytes) -> str:
    """The status of an encoded HealthCheckResponse: field 1, a varint (absent: 0, UNKNOWN)."""
    status, i = 0, 0
    while i < len(raw):
        tag = raw[i]
        i += 1
        value, shift = 0, 0
        while i < len(raw):
            byte = raw[i]
            i += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        if tag != 0x08:  # only varint fields are expected; anything else says nothing of the status
            return "UNKNOWN"
        status = value
    return STATUSES.get(status, "UNKNOWN")


def check(endpoint: str, security: ClientSecurity, timeout_s: float) -> Health:
    started = time.monotonic()
    try:
        with security.channel(endpoint) as channel:
            call = channel.unary_unary(HEALTH_CHECK, request_serializer=lambda _: b"",
                                       response_deserializer=lambda raw: raw)
            raw = call(b"", timeout=timeout_s)
        return Health(endpoint, serving_status(raw), (time.monotonic() - started) * 1000)
    except grpc.RpcError as exc:
        code = exc.code() if callable(getattr(exc, "code", None)) else None
        status = "UNREACHABLE" if code == grpc.StatusCode.UNAVAILABLE else "ERROR"
        details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
        return Health(endpoint, status, (time.monotonic() - started) * 1000,
                      one_line(f"{code.name if code else 'ERROR'}: {details}"))


def health(endpoints: Sequence[str], security: ClientSecurity, timeout_s: float, printer: Printer) -> int:
    """One line (or JSON object) per endpoint; 0 if every one serves, 4 if none answered, else 1."""
    results = [check(e, security, timeout_s) for e in endpoints]
    if printer.json:
        for r in results:
            printer.record({"endpoint": r.endpoint, "status": r.status, "took_ms": round(r.took_ms, 1),
                            "healthy": r.status == "SERVING", "error": r.error})
    else:
        printer.line(format_table(["ENDPOINT", "STATUS", "TOOK_MS", "ERROR"],
                                  [[r.endpoint, r.status, f"{r.took_ms:.1f}", r.error or "-"] for r in results]))
    if all(r.status == "SERVING" for r in results):
        return EXIT_OK
    return EXIT_UNREACHABLE if all(r.status == "UNREACHABLE" for r in results) else EXIT_ERROR


# ---- completion ----------------------------------------------------------------------------------

SHELLS = ("bash", "zsh", "fish")


def _commands(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """Each command (aliases included) -> its options, from the parser itself."""
    out: dict[str, list[str]] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out[name] = sorted({o for a in sub._actions for o in a.option_strings if o.startswith("--")})
    return out


def completion(shell: str, parser: argparse.ArgumentParser) -> str:
    commands = _commands(parser)
    globals_ = sorted({o for a in parser._actions for o in a.option_strings if o.startswith("--")})
    if shell == "fish":
        lines = ["# kvstore completion for fish: kvstore completion fish > ~/.config/fish/completions/kvstore.fish",
                 "complete -c kvstore -f",
                 f"complete -c kvstore -n __fish_use_subcommand -a '{' '.join(sorted(commands))}'"]
        lines += [f"complete -c kvstore -n __fish_use_subcommand -l {o[2:]}" for o in globals_]
        for name, options in sorted(commands.items()):
            lines += [f"complete -c kvstore -n '__fish_seen_subcommand_from {name}' -l {o[2:]}" for o in options]
        return "\n".join(lines) + "\n"
    cases = "\n".join(f"        {name}) opts=\"{' '.join(options)}\" ;;" for name, options in sorted(commands.items()))
    script = f"""# kvstore completion for {shell}: eval "$(kvstore completion {shell})" (in ~/.{shell}rc)
_kvstore() {{
    local cur cmd opts i
    cur="${{COMP_WORDS[COMP_CWORD]}}"
    cmd=""
    for ((i = 1; i < COMP_CWORD; i++)); do
        case "${{COMP_WORDS[i]}}" in -*) ;; *) cmd="${{COMP_WORDS[i]}}"; break ;; esac
    done
    if [[ -z "$cmd" ]]; then
        if [[ "$cur" == -* ]]; then opts="{' '.join(globals_)}"; else opts="{' '.join(sorted(commands))}"; fi
    else
        case "$cmd" in
{cases}
        *) opts="" ;;
        esac
    fi
    COMPREPLY=($(compgen -W "$opts" -- "$cur"))
}}
"""
    if shell == "zsh":
        script = "autoload -U +X bashcompinit && bashcompinit\n" + script
    return script + "complete -o default -F _kvstore kvstore\n"
