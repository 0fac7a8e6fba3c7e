"""The benchmarks' shared writer (bench/writer.py) and the benchmark pages it writes into."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pytest

from bench import writer
from tests import REPO

PAGES = REPO / "docs" / "benchmarks"
MARK = re.compile(r"<!-- (/?)bench:([^ ]+) -->")


def _recorder(tmp_path: Path, page: str = "demo", *extra: str) -> writer.Recorder:
    parser = argparse.ArgumentParser()
    writer.add_arguments(parser)
    args = parser.parse_args(["--report-dir", str(tmp_path), *extra])
    recorder = writer.Recorder(page, args)
    return recorder


def test_a_section_replaces_only_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", [str(REPO / "bench" / "demo.py"), "--k", "8", "--report-dir", str(tmp_path)])
    page = tmp_path / "demo.md"
    page.write_text(
        "# Demo\n\nProse written by hand.\n\n<!-- bench:a -->\nold a\n<!-- /bench:a -->\n\n"
        "<!-- bench:b -->\nold b\n<!-- /bench:b -->\n\nTrailing prose.\n"
    )
    recorder = _recorder(tmp_path)
    recorder.write("a", title="the a run", columns=["x", "y"], rows=[[1, "2 | 3"]], result="ratio 1.50x", notes=["n1"])
    text = page.read_text()
    assert "old a" not in text and "old b" in text  # its own section replaced, the other kept
    assert text.startswith("# Demo\n\nProse written by hand.\n") and text.rstrip().endswith("Trailing prose.")
    section = text[text.index("<!-- bench:a -->") : text.index("<!-- /bench:a -->")]
    assert "### the a run {#a}" in section
    assert "python bench/demo.py --k 8\n" in section  # the command from the repository root, less --report-dir
    assert "Machine: " in section and " cores (" in section
    assert re.search(r"Load \(1-minute average\): [0-9.]+ at the start, [0-9.]+ at the end, [0-9.]+ at most", section)
    assert "| x | y |" in section and "| 1 | 2 \\| 3 |" in section  # a | inside a cell is escaped
    assert "**Result:** ratio 1.50x" in section and "- n1" in section
    recorder.write("c", title="new", columns=["x"], rows=[["v"]], result="r")
    text = page.read_text()
    assert text.index("<!-- /bench:b -->") < text.index("<!-- bench:c -->")  # a new variant is appended
    recorder.close()


def test_no_report_writes_nothing_and_bad_rows_are_refused(tmp_path: Path) -> None:
    recorder = _recorder(tmp_path, "demo", "--no-report")
    assert recorder.write("a", title="t", columns=["x"], rows=[["v"]], result="r") is None
    assert not (tmp_path / "demo.md").exists()
    with pytest.raises(ValueError, match="2 cells for 1 columns"):
        recorder.write("a", title="t", columns=["x"], rows=[["v", "w"]], result="r")
    with pytest.raises(ValueError, match="variant"):
        recorder.write("Bad Name", title="t", columns=["x"], rows=[["v"]], result="r")
    with pytest.raises(ValueError, match="no end marker"):
        writer.replace_section("<!-- bench:a -->\nno end", "a", "new")
    recorder.close()


def test_every_benchmark_writes_its_page() -> None:
    """Each bench script records through the writer, into a page that exists and is in the site's nav."""
    nav = (REPO / "mkdocs.yml").read_text()
    helpers = {"writer", "device_fixtures", "limits", "multilora_report", "peak_rss", "peer_trl", "trl_env", "trl_grpo"}
    scripts = sorted(p for p in (REPO / "bench").glob("*.py") if p.stem not in helpers)  # helpers: imported, no page
    assert scripts
    for script in scripts:
        source = script.read_text()
        pages = re.findall(r'writer\.Recorder\("([a-z0-9-]+)"', source)
        assert pages, f"{script.name} does not write its table through bench/writer.py"
        for page in pages:
            assert (PAGES / f"{page}.md").is_file(), f"{script.name} writes docs/benchmarks/{page}.md, which is missing"
            assert f"benchmarks/{page}.md" in nav, f"docs/benchmarks/{page}.md is not in the mkdocs nav"


@pytest.mark.parametrize("page", sorted(p.name for p in PAGES.glob("*.md")))
def test_benchmark_pages_have_well_formed_sections(page: str) -> None:
    """Markers open and close in pairs, and each section's heading carries its variant as the anchor."""
    text = (PAGES / page).read_text()
    open_variant = None
    for closing, variant in MARK.findall(text):
        if not closing:
            assert open_variant is None, f"{page}: section {variant!r} opens inside {open_variant!r}"
            open_variant = variant
        else:
            assert open_variant == variant, f"{page}: {variant!r} closes, {open_variant!r} was open"
            open_variant = None
    assert open_variant is None, f"{page}: section {open_variant!r} is never closed"
    for variant in {v for _, v in MARK.findall(text)}:
        body = text[text.index(f"<!-- bench:{variant} -->") : text.index(f"<!-- /bench:{variant} -->")]
        assert re.search(rf"^### .+ \{{#{re.escape(variant)}\}}$", body, re.M), f"{page}: {variant!r} heading"
        assert "Machine: " in body and "Load" in body and "**Result:**" in body, f"{page}: {variant!r}"
