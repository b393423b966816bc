"""The documentation against the code: the options table, the README's size and links, install hints.

Fast and offline: it reads files, builds ``Settings`` and asks the CLI for its help text.
"""

from __future__ import annotations

import configparser
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from kombu_delay.config import Settings
from kombu_delay.errors import EXTRAS, ConfigError, needs_extra

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_LINES = 300

#: One row of docs/configuration.md's options table:
#: | `delay_x` | `KOMBU_DELAY_X` | unit | default | meaning |
ROW = re.compile(r"^\| `(delay_\w+)` \| `(KOMBU_DELAY_\w+)` \| ([^|]+) \| ([^|]+) \| (.+) \|$")
#: A Markdown link or image target: [text](target).
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def option_name(field_name: str) -> str:
    """The option a Settings field is set by, as config.py names it: ``delay_`` + the field
    name without its ``_ms`` unit."""
    return "delay_" + field_name.removesuffix("_ms")


def documented() -> dict[str, dict[str, str]]:
    rows: dict[str, dict[str, str]] = {}
    for line in (DOCS / "configuration.md").read_text().splitlines():
        match = ROW.match(line)
        if match:
            option, env, unit, default, meaning = (part.strip() for part in match.groups())
            assert option not in rows, f"{option} is documented twice"
            rows[option] = {"env": env, "unit": unit, "default": default, "meaning": meaning}
    return rows


def user_value(field_name: str, value: Any) -> Any:
    """A field's value as a user writes it: seconds for a ``*_ms`` field."""
    return value / 1000 if field_name.endswith("_ms") else value


def documented_default(text: str) -> Any:
    """The value a default cell starts with: ``604800 (7 days), at least 3600`` -> 604800."""
    match = re.match(r"(true|false|\d+(?:\.\d+)?)\b", text)
    assert match, f"the default {text!r} does not start with a value"
    word = match.group(1)
    if word in ("true", "false"):
        return word == "true"
    return float(word) if "." in word else int(word)


def test_every_option_is_documented_and_nothing_else() -> None:
    in_code = {option_name(f.name) for f in fields(Settings)}
    in_docs = set(documented())
    assert in_docs - in_code == set(), "documented in docs/configuration.md, but no such option"
    assert in_code - in_docs == set(), "options missing from docs/configuration.md"


@pytest.mark.parametrize("field_name", [f.name for f in fields(Settings)])
def test_documented_option_default_unit_and_variable(field_name: str) -> None:
    option = option_name(field_name)
    row = documented()[option]
    default = getattr(Settings(), field_name)

    assert row["env"] == "KOMBU_DELAY_" + option.removeprefix("delay_").upper()
    if isinstance(default, bool):
        assert row["unit"] == "bool"
    elif field_name.endswith("_ms"):
        assert row["unit"] == "s"
    else:
        assert row["unit"] in ("messages", "messages/s")
    assert documented_default(row["default"]) == user_value(field_name, default)

    # The documented names and default are what the code reads: as a transport option and as a
    # variable, the documented default gives the default settings, and another value changes
    # this field alone.
    given = documented_default(row["default"])
    assert Settings.from_options({option: given}, env={}) == Settings()
    assert Settings.from_options({}, env={row["env"]: str(given).lower()}) == Settings()
    other = (not given) if isinstance(given, bool) else (given * 2 or 5)
    changed = Settings.from_options({option: other}, env={})
    assert [f.name for f in fields(Settings) if getattr(changed, f.name) != getattr(Settings(), f.name)] == [
        field_name
    ]


def test_an_undocumented_option_is_refused() -> None:
    # What makes "nothing documented that does not exist" checkable: unknown delay_* keys fail.
    with pytest.raises(ConfigError, match="unknown transport option 'delay_no_such_option'"):
        Settings.from_options({"delay_no_such_option": 1}, env={})


def test_documented_mover_flags_exist_and_every_option_flag_is_documented() -> None:
    help_text = subprocess.run(
        [sys.executable, "-m", "kombu_delay", "mover", "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    flags = set(re.findall(r"^\s+(--[a-z][a-z-]*)", help_text, re.MULTILINE))
    rows = documented()
    for option, row in rows.items():
        for flag in re.findall(r"Mover flag `(--[a-z-]+)`", row["meaning"]):
            assert flag in flags, f"{option}: `kombu-delay mover` has no {flag}"
    for flag in flags:
        option = "delay_" + flag.removeprefix("--").replace("-", "_")
        if option in rows:
            assert f"Mover flag `{flag}`" in rows[option]["meaning"], f"{option}: say that {flag} sets it"


def test_readme_is_the_front_door_not_the_manual() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; the manual belongs in docs/"


def anchors(path: Path) -> set[str]:
    """Heading anchors as GitHub and mkdocs make them (lower case, punctuation dropped)."""
    found = set()
    fenced = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"\s+", "-", re.sub(r"[^\w\s-]", "", title)).strip("-"))
    return found


@pytest.mark.parametrize("page", ["README.md", "CHANGELOG.md", *sorted(p.name for p in DOCS.glob("*.md"))])
def test_relative_links_resolve(page: str) -> None:
    path = ROOT / page if page in ("README.md", "CHANGELOG.md") else DOCS / page
    broken = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"^[a-z]+:", target):
            continue  # https:, mailto:: not checked here (no network)
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in anchors(linked)):
            broken.append(target)
    assert broken == [], f"{page}: links that do not resolve"


def test_install_hints_name_extras_that_exist() -> None:
    config = configparser.ConfigParser(interpolation=None)
    config.read(ROOT / "setup.cfg")
    extras = set(config["options.extras_require"])
    texts = {p.name: p.read_text() for p in [README, *DOCS.glob("*.md")]}
    for name, text in texts.items():
        for hint in re.findall(r"(?:kombu-delay|'\.|\"\.)\[([a-z,]+)\]", text):
            for extra in hint.split(","):
                assert extra in extras, f"{name}: an install hint names [{extra}], which setup.cfg lacks"


def test_the_packages_an_error_names_for_an_extra_are_setup_cfgs() -> None:
    # An error needing an extra names its packages ("pip install 'kombu-delay[web]'" fails until
    # the package is on an index): they must be the ones the extra installs.
    config = configparser.ConfigParser(interpolation=None)
    config.read(ROOT / "setup.cfg")
    for extra, packages in EXTRAS.items():
        assert config["options.extras_require"][extra].split() == list(packages), extra
    assert needs_extra("--metrics-port", "metrics") == (
        "--metrics-port needs the metrics extra: pip install 'prometheus-client>=0.17'"
    )


def test_every_extra_is_listed_in_the_readme_and_the_install_table() -> None:
    config = configparser.ConfigParser(interpolation=None)
    config.read(ROOT / "setup.cfg")
    listed = re.search(r"The extras are (.+?): see", README.read_text(), re.S)
    assert listed, "the README lists the extras"
    in_table = set(re.findall(r"^\| `(\w+)` \|", (DOCS / "getting-started.md").read_text(), re.M))
    for extra in config["options.extras_require"]:
        assert f"`{extra}`" in listed.group(1), f"the README's list of extras lacks {extra}"
        assert extra in in_table, f"the extras table of getting-started.md lacks {extra}"


def test_the_proxy_example_keeps_the_port_the_origin_check_compares() -> None:
    # nginx's $host drops the port: behind a proxy on another port every action was refused.
    text = (DOCS / "dashboard.md").read_text()
    headers = re.findall(r"proxy_set_header Host (\S+);", text)
    assert headers == ["$http_host"], headers


def test_every_option_named_anywhere_exists() -> None:
    in_code = {option_name(f.name) for f in fields(Settings)}
    for path in [README, *DOCS.glob("*.md")]:
        named = set(re.findall(r"`(delay_[a-z_]*[a-z])(?=[`= ])", path.read_text()))
        assert named - in_code == set(), f"{path.name} names options that do not exist"
