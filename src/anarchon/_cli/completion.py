"""``anarchon completion bash|zsh``: a shell completion script, made from the parser
itself (so it cannot drift from the commands and their options)::

    eval "$(anarchon completion bash)"     # in ~/.bashrc
    eval "$(anarchon completion zsh)"      # in ~/.zshrc
"""

from __future__ import annotations

import argparse

__all__ = ["completion_script"]


def _commands(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """Each command and its options, from the parser."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            choices: dict[str, argparse.ArgumentParser] = action.choices
            return {
                name: sorted(
                    option
                    for sub in command._actions
                    for option in sub.option_strings
                    if option.startswith("--")
                )
                for name, command in choices.items()
            }
    return {}


def completion_script(shell: str, parser: argparse.ArgumentParser) -> str:
    commands = _commands(parser)
    cases = "\n".join(
        f'        {name}) words="{" ".join(options)}" ;;' for name, options in commands.items()
    )
    bash = f"""_anarchon() {{
    local cur="${{COMP_WORDS[COMP_CWORD]}}" words=""
    if [ "$COMP_CWORD" -le 1 ]; then
        COMPREPLY=($(compgen -W "{" ".join(commands)} --help --version" -- "$cur"))
        return 0
    fi
    case "${{COMP_WORDS[1]}}" in
{cases}
    esac
    COMPREPLY=($(compgen -W "$words --help" -- "$cur"))
    return 0
}}
complete -F _anarchon anarchon
"""
    if shell == "zsh":
        return "autoload -U +X bashcompinit && bashcompinit\n" + bash
    return bash
