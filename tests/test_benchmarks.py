"""`make bench`'s page: a partial rerun (--only) replaces its own rows and keeps the others and their note."""

from __future__ import annotations

from benchmarks.run_all import existing, write


def test_the_benchmarks_page_reads_back_what_it_wrote(tmp_path) -> None:
    rows = [{"name": f"bench {i}", "figure": f"{i} steps/s<br>more", "target": ">= 1", "command": f"python b{i}.py",
             "seconds": str(i), "load": "1.0 -> 1.1"} for i in range(3)]
    page = tmp_path / "benchmarks.md"
    write(rows, page, "Ran beside the study.")
    again, note = existing(page)
    assert again == rows and note == "Ran beside the study."
    write(rows, page)
    assert existing(page) == (rows, "")
