"""README.md and tests/figures/README.md: every command they show still parses, every link resolves.

Each `python SCRIPT ...` command in a fenced block or an inline code span is split as a shell
would (line continuations, `;`, `&&`, `|`, `&`, a `for VAR in ...` loop's first value for `$VAR`,
`VAR=value` lines and prefixes, `timeout` and `nice`), then its flags are parsed by the script's
own parser: tyro against `Args` for the four scripts, argparse for tests/plot.py and
tests/benchmark.py. Nothing is trained, drawn or measured, so a renamed or removed flag, or a value
a flag no longer takes, fails here in seconds.
"""

import argparse
import bisect
import itertools
import re
import shlex
import sys

import pytest
import tyro

from conftest import ROOT, load

DOCS = ("README.md", "tests/figures/README.md")
SCRIPTS = ("anakin_catch.py", "anakin_ppo.py", "sebulba_impala.py", "sebulba_ppo_atari.py")
TOOLS = ("tests/plot.py", "tests/evaluate.py", "tests/benchmark.py")
# Copies of an old commit's script (`git show 1baef03:sebulba_ppo_atari.py > ppo_1baef03.py`, the
# Pong run's story in tests/figures/README.md; the IMPALA probes' landed code) are history: today's
# flags need not match them.
HISTORY = ("ppo_1baef03.py", "impala_landed.py", "impala_init1.py")
SEPARATORS = {";", "&&", "||", "|", "&", "do", "then", "done", "fi"}
REDIRECTS = {">", ">>", "<"}


def code_texts(doc):
    """(line number, text) of each fenced code block and each inline code span of `doc`."""
    texts, fence, paragraph = [], None, []

    def end_paragraph():  # its inline code spans (a span may run across lines)
        text = " ".join(part.rstrip("\\") for _, part in paragraph)
        starts = list(itertools.accumulate(len(part) + 1 for _, part in paragraph))
        texts.extend((paragraph[bisect.bisect(starts, span.start())][0], span.group(1))
                     for span in re.finditer(r"`([^`]+)`", text))
        paragraph.clear()

    for number, line in enumerate((ROOT / doc).read_text().splitlines() + [""], start=1):
        if line.startswith("```"):
            if fence is None:
                end_paragraph()
                fence = (number + 1, [])
            else:
                texts.append((fence[0], "\n".join(fence[1])))
                fence = None
        elif fence is not None:
            fence[1].append(line)
        elif line.strip():
            paragraph.append((number, line))
        else:
            end_paragraph()
    return texts


def split_words(line):
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def simple_commands(text):
    """The simple commands of a shell snippet, as word lists, with loop and assigned variables
    substituted (a loop variable takes the loop's first value)."""
    variables, commands = {}, []
    for line in text.replace("\\\n", " ").splitlines():
        command = []
        for word in split_words(line) + [";"]:
            if word not in SEPARATORS:  # $VAR and ${VAR}; an unknown one stays as it is
                command.append(re.sub(r"\$\{?(\w+)\}?", lambda m: variables.get(m.group(1), m.group(0)), word))
                continue
            if command[:1] == ["for"] and len(command) > 3:  # for VAR in FIRST ...
                variables[command[1]] = command[3]
            elif command and all(re.match(r"^\w+=", w) for w in command):  # VAR=value lines
                variables.update(w.split("=", 1) for w in command)
            elif command:
                commands.append(command)
            command = []
    return commands


def unwrap(command):
    """A command without its `VAR=value` prefixes, `timeout`/`nice` wrappers and redirections."""
    words = [w for i, w in enumerate(command)
             if w not in REDIRECTS and (i == 0 or command[i - 1] not in REDIRECTS)]
    while words:
        if re.match(r"^\w+=", words[0]):
            words = words[1:]
        elif words[0] == "timeout":  # timeout [-s SIGNAL] [-k DURATION] DURATION COMMAND
            words = words[1:]
            while words[0].startswith("-"):
                words = words[2:] if words[0] in ("-s", "-k") else words[1:]
            words = words[1:]
        elif words[0] == "nice":  # nice [-n N | -N] COMMAND
            words = words[3:] if words[1] == "-n" else words[2:] if words[1].startswith("-") else words[1:]
        else:
            return words
    return words


def python_commands():
    """(doc:line, script, flags) of every `python SCRIPT ...` command in the docs."""
    found = []
    for doc in DOCS:
        for line, text in code_texts(doc):
            if "python" not in text:
                continue
            for command in map(unwrap, simple_commands(text)):
                if command[:1] in (["python"], ["python3"]) and len(command) > 1 and command[1] != "-m":
                    found.append((f"{doc}:{line}", command[1], command[2:]))
    return found


COMMANDS = python_commands()


class Parsed(Exception):
    """Raised by a patched argparse once tests/benchmark.py's flags are parsed, before it runs."""


def check_flags(script, flags, monkeypatch):
    """Parse `flags` with the parser `script` itself uses; a bad flag raises SystemExit."""
    if script in SCRIPTS:
        tyro.cli(load(script).Args, args=flags)
    elif script in ("tests/plot.py", "tests/evaluate.py"):
        monkeypatch.chdir(ROOT)  # -o and --gif must name an existing folder, relative to the repository
        load(script).parse_args(flags)
    elif script == "tests/benchmark.py":
        parse_args = argparse.ArgumentParser.parse_args

        def parse_then_stop(parser, args=None, namespace=None):
            raise Parsed(parse_args(parser, args, namespace))

        monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        monkeypatch.setattr(sys, "argv", [script, *flags])
        with pytest.raises(Parsed):
            load(script).main()
    else:
        raise AssertionError(f"{script}: not a script of this repository (history? see HISTORY)")


@pytest.mark.parametrize("where,script,flags", [c for c in COMMANDS if c[1] not in HISTORY],
                         ids=[f"{where} {script}" for where, script, _ in COMMANDS if script not in HISTORY])
def test_documented_command_parses_with_the_scripts_flags(where, script, flags, monkeypatch, capsys):
    try:
        check_flags(script, flags, monkeypatch)
    except SystemExit as stop:
        if stop.code != 0 or "--help" not in flags:
            pytest.fail(f"{where}: python {shlex.join([script, *flags])}\n{capsys.readouterr().err}")


def test_every_script_and_tool_has_a_checked_command_in_the_readme():
    readme = {script for where, script, _ in COMMANDS if where.startswith("README.md:")}
    assert set(SCRIPTS + TOOLS) <= readme, readme
    assert {script for _, script, _ in COMMANDS} <= set(SCRIPTS + TOOLS + HISTORY)


def test_a_renamed_flag_or_a_bad_value_fails(monkeypatch, capsys):
    for flags in (["--total-steps", "1000"], ["--total-timesteps", "many"]):
        with pytest.raises(SystemExit) as stop:
            check_flags("anakin_catch.py", flags, monkeypatch)
        assert stop.value.code == 2
    with pytest.raises(SystemExit):
        check_flags("tests/plot.py", ["runs/x", "-o", "x.png", "--no-such-flag"], monkeypatch)


def test_shell_snippets_split_into_the_commands_a_shell_would_run():
    text = ("for s in 1 2; do\n  XLA_FLAGS=--x=2 nice -n 5 timeout -s INT 60 python a.py --seed $s \\\n"
            "    --title \"one two\"   # comment\ndone\nv=\"run $s\" && python b.py --t \"$v\" > out.txt")
    assert [unwrap(c) for c in simple_commands(text)] == [
        ["python", "a.py", "--seed", "1", "--title", "one two"], ["python", "b.py", "--t", "run 1"]]


def anchor(heading):
    """GitHub's anchor for a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip("# ").lower()).replace(" ", "-")


@pytest.mark.parametrize("doc", DOCS)
def test_every_relative_link_and_picture_exists(doc):
    path = ROOT / doc
    links = re.findall(r"\]\(([^)\s]+)\)", path.read_text())
    assert links
    for link in links:
        if link.startswith(("http://", "https://")):
            continue
        target, _, fragment = link.partition("#")
        target = (path.parent / target).resolve() if target else path
        assert target.exists(), f"{doc}: {link}"
        if fragment:
            headings = [anchor(line) for line in target.read_text().splitlines() if line.startswith("#")]
            assert fragment in headings, f"{doc}: {link}"


def test_requirements_point_to_a_readme_section_that_exists():
    (section,) = re.findall(r'README.md, section "([^"]+)"', (ROOT / "requirements.txt").read_text())
    assert f"## {section}" in (ROOT / "README.md").read_text().splitlines()


def test_the_readme_names_the_pythons_ci_checks():
    """README's "Python 3.11 to 3.13" is the range .ci/pythons installs and runs on (and requirements.txt says);
    a Python its "Untested, ...: Python 3.14 (...)" line names is outside that range."""
    readme = (ROOT / "README.md").read_text()
    first, last = re.search(r"^Python 3\.(\d+) to 3\.(\d+) ", readme, re.M).groups()
    checked = re.search(r"^versions=\(([^)]*)\)", (ROOT / ".ci/pythons").read_text(), re.M).group(1).split()
    assert checked == [f"3.{minor}" for minor in range(int(first), int(last) + 1)]
    assert f"Python 3.{first} to 3.{last}" in (ROOT / "requirements.txt").read_text()
    for minor in re.findall(r"^Untested\b[^.]*?\bPython 3\.(\d+)", readme, re.M):
        assert f"3.{minor}" not in checked, f"README calls Python 3.{minor} untested, but .ci/pythons checks it"
