"""The command line as a shell meets it: options from the environment, and completion.
No server needed."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from anarchon._cli.main import build_parser
from tests.test_run_command import ROOT


def test_the_store_commands_take_the_prefix_and_the_server_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ANARCHON_PREFIX", "billing:")
    monkeypatch.setenv("ANARCHON_REDIS_URL", "redis://store:6379/2")
    for argv in (["inspect"], ["history", "job"], ["web"]):
        args = build_parser().parse_args(argv)
        assert (args.prefix, args.redis) == ("billing:", "redis://store:6379/2"), argv
    assert build_parser().parse_args(["inspect", "--prefix", "other:"]).prefix == "other:"


def _completion(shell: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "anarchon", "completion", shell],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash on this machine")
def test_bash_completes_the_commands_and_each_commands_options() -> None:
    script = _completion("bash")

    def complete(line: str) -> set[str]:
        words = line.split(" ")
        probe = (
            f"{script}\nCOMP_WORDS=({' '.join(repr(w) for w in words)}); "
            f"COMP_CWORD={len(words) - 1}; _anarchon; printf '%s\\n' \"${{COMPREPLY[@]}}\""
        )
        done = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        return set(done.stdout.split())

    assert {"demo", "run", "health", "inspect", "history", "web", "completion"} <= complete(
        "anarchon "
    )
    assert complete("anarchon hi") == {"history"}
    assert {"--redis", "--prefix", "--limit", "--json"} <= complete("anarchon history --")
    assert {"--health-port", "--metrics-port"} <= complete("anarchon run --")


def test_zsh_completion_is_the_bash_one_through_bashcompinit() -> None:
    script = _completion("zsh")
    assert "bashcompinit" in script and "complete -F _anarchon anarchon" in script


def test_probes_and_metrics_listen_on_this_machine_only_unless_told() -> None:
    """An orchestrator that probes the pod's address (Kubernetes' httpGet) or scrapes it
    says so with --health-host/--metrics-host 0.0.0.0; nobody else exposes them."""
    import inspect

    from anarchon import serve

    args = build_parser().parse_args(["run", "app:scheduler"])
    assert (args.health_host, args.metrics_host) == ("127.0.0.1", "127.0.0.1")
    assert inspect.signature(serve).parameters["health_host"].default == "127.0.0.1"


def test_acl_prints_the_line_without_client_setinfo_for_redis_7_0(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Redis 7.0 refuses a rule that names CLIENT SETINFO: ``--no-setinfo`` leaves it out,
    and nothing else."""
    from anarchon._cli.main import main

    assert main(["acl", "--prefix", "cron:"]) == 0
    full = capsys.readouterr().out.split()
    assert main(["acl", "--prefix", "cron:", "--no-setinfo"]) == 0
    without = capsys.readouterr().out.split()
    assert "+client|setinfo" in full
    assert [rule for rule in full if rule != "+client|setinfo"] == without


def test_every_option_says_its_default_and_every_command_what_it_does() -> None:
    """``anarchon COMMAND --help`` (and the generated reference page) shows each option's
    default, and each command has a line in the list and a description of its own. A
    flag (on or off, off by default) and --help and --version are the exceptions."""
    import argparse

    parser = build_parser()
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    listed = {choice.dest: choice.help for choice in subparsers._choices_actions}
    flags = (
        argparse._HelpAction,
        argparse._VersionAction,
        argparse._StoreTrueAction,
        argparse._StoreFalseAction,
    )
    unsaid = []
    for name, command in subparsers.choices.items():
        if not listed.get(name):
            unsaid.append(f"{name}: no line in the list of commands")
        if not command.description:
            unsaid.append(f"{name}: no description")
        for action in command._actions:
            optional = action.option_strings and not isinstance(action, flags)
            if optional and "default" not in (action.help or ""):
                unsaid.append(f"{name} {'/'.join(action.option_strings)}: no default said")
    assert subparsers.choices, "no command found: the check above would check nothing"
    assert not unsaid, unsaid
