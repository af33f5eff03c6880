"""docs/cli.md against the CLI's parser: its synopsis is streamring.cli.synopsis() (made from build_parser), and the
options the page and the code disagreed on take what users type."""

from __future__ import annotations

import re

from conftest import ROOT

from streamring.cli import build_parser, main, synopsis

CLI_MD = ROOT / "docs" / "cli.md"


def test_cli_md_synopsis_is_the_parsers():
    text = CLI_MD.read_text()
    m = re.search(r"^```text\n(streamring .*?)\n```$", text, re.M | re.S)
    assert m, "docs/cli.md has no ```text block starting with `streamring`"
    assert m.group(1) == synopsis(), (
        "docs/cli.md's synopsis differs from the parser's; put this in its place:\n" + synopsis())


def test_synopsis_names_every_option_of_every_command():
    text = synopsis()
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, p in sub.choices.items():
        assert f"streamring {name}" in text
        for a in p._actions:
            for flag in a.option_strings:
                if flag.startswith("--") and flag != "--help":
                    assert re.search(rf"\[{re.escape(flag)}[\] ]", text), (name, flag)


def test_timeline_takes_several_token_counts_after_one_option(tmp_path, capsys, monkeypatch):
    """``--tokens 1024 4096`` (what docs/cli.md shows and users type) and the repeated form both select; the
    command then draws those timelines (the drawing itself: tests/unit/test_adaptive_timeline.py)."""
    from streamring import timeline

    p = build_parser()
    assert p.parse_args(["timeline", "f.json", "--tokens", "1024", "4096"]).tokens == [1024, 4096]
    assert p.parse_args(["timeline", "f.json", "--tokens", "1024", "--tokens", "4096"]).tokens == [1024, 4096]
    drawn = []
    monkeypatch.setattr(timeline, "draw", lambda tls, out: drawn.extend(tls) or out)
    src = ROOT / "docs" / "results" / "ep-timelines-2h200-triton-2026-11-30.json"
    assert main(["timeline", str(src), "--out", str(tmp_path / "t.png"), "--tokens", "1024", "4096"]) == 0
    assert sorted({t["tokens"] for t in drawn}) == [1024, 4096]
    out = capsys.readouterr().out
    assert sorted({int(t) for t in re.findall(r"^(\d+) tokens,", out, re.M)}) == [1024, 4096], out
