"""`ampdoctor scan PATH...` (CONTRACT §6): the double-scaling search alone.

Exit codes: 0 at most one loss-scale owner per training path (nothing found), 1 more than one
loss-scale owner found (a `double-scaling` error or warning), 2 a path that does not exist or
a usage error. The static hints (warnings) never change the exit code, unless `--strict`: then
a hint is exit 1 too. `ampdoctor.cli` wires `run_scan` in; `python -m ampdoctor.scan.command`
runs it without the rest of the CLI (and without torch).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ampdoctor.scan.sites import ScanReport

FORMATS = ("text", "json", "sarif")


def _say(text: str) -> None:
    """One line on stderr, its user text (paths, messages) already made inert."""
    print(text, file=sys.stderr)


def _summary_line(report: ScanReport) -> str:
    from ampdoctor.core.safetext import inert
    from ampdoctor.scan.sites import display_path

    parts = [f"{len(report.owners)} loss-scale owner(s)"]
    for finding in report.findings:
        loc = finding.location
        where = (inert(f"{display_path(loc.file, report.display_base)}:{loc.line}",
                       multiline=False) if loc else "")
        parts.append(f"{finding.severity} {finding.kind} at {where}")
    if report.hints:
        parts.append(f"{len(report.hints)} static hint(s)")
    return "; ".join(parts)


def run_scan(
    paths: list[str],
    as_json: bool = False,
    fmt: str = "text",
    output: str | None = None,
    debug: bool = False,
    strict: bool = False,
) -> int:
    """Scan `paths`, print the report (text, JSON or SARIF), return the exit code."""
    from ampdoctor.core.safetext import FIELD_LIMIT, exc_text, inert, safe_str
    from ampdoctor.scan import ScanPathError, scan_paths
    from ampdoctor.scan.render import render_text, to_json, to_sarif

    fmt = "json" if as_json else (fmt or "text").lower()
    if fmt not in FORMATS:
        _say(f"ampdoctor scan: unknown format {inert(repr(fmt), limit=FIELD_LIMIT)} "
             f"(use one of {', '.join(FORMATS)})")
        return 2
    if not paths:
        print("ampdoctor scan: give at least one PATH (a file or a folder)", file=sys.stderr)
        return 2
    try:
        report = scan_paths(paths, display_base=os.getcwd(), strict=strict)
    except ScanPathError as exc:
        _say(f"ampdoctor scan: {inert(safe_str(exc), limit=FIELD_LIMIT, multiline=False)}")
        return 2
    except Exception as exc:  # noqa: BLE001 - a bug in the scan itself, not in the user's code
        if debug:
            traceback.print_exc()
        _say(f"ampdoctor scan: internal error: {inert(exc_text(exc), multiline=False)} "
             "(run with --debug for the traceback)")
        return 2
    if debug:
        print(f"ampdoctor scan: {report.files_scanned} files in {report.seconds:.3f} s, "
              f"{len(report.skipped)} skipped", file=sys.stderr)

    if output:
        try:
            with open(output, "w", encoding="utf-8") as handle:
                if fmt == "text":
                    render_text(report, file=handle, color=False)
                else:
                    handle.write(to_json(report) if fmt == "json" else to_sarif(report))
        except OSError as exc:
            _say(f"ampdoctor scan: cannot write {inert(output, multiline=False)}: "
                 f"{inert(safe_str(exc.strerror or exc), multiline=False)}")
            return 2
        _say(f"ampdoctor scan: {_summary_line(report)}; wrote {inert(output, multiline=False)}")
    elif fmt == "text":
        render_text(report)
    else:
        sys.stdout.write(to_json(report) if fmt == "json" else to_sarif(report))
        sys.stdout.flush()
    return report.exit_code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ampdoctor scan",
        description="Search code and configs for more than one loss-scale owner "
        "(never imports or runs the scanned code).",
    )
    parser.add_argument("paths", nargs="*", metavar="PATH")
    parser.add_argument("--json", action="store_true", help="the report as JSON on stdout")
    parser.add_argument("--format", dest="fmt", default="text", choices=FORMATS)
    parser.add_argument("-o", "--output", default=None, help="write the report to this file")
    parser.add_argument("--strict", action="store_true", help="a static hint fails (exit 1)")
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)
    return run_scan(args.paths, as_json=args.json, fmt=args.fmt, output=args.output,
                    debug=args.debug, strict=args.strict)


if __name__ == "__main__":
    sys.exit(main())
