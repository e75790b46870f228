"""Regenerate the postmortem screenshots shown in the README: a healthy, a failed and an error
page, each diagnosed from a sample config, rendered with `ampdoctor report --html` and
photographed by headless Chromium.

    python docs/screenshots/make.py          # needs chromium (Debian: apt install chromium)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WIDTH = 1200   # CSS pixels
PAGES = {  # name: (sample config, window height in CSS pixels: the error page is short)
    "healthy": ("sample_configs/healthy_adamw_clip_sched.yaml", 2000),
    "failed": ("sample_configs/broken_clip_before_unscale.yaml", 2000),
    "error": ("sample_configs/bad/factory_raises.yaml", 1000),
}


def chromium() -> str:
    found = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")
                  if shutil.which(n)), None)
    if found is None:
        sys.exit("no chromium on PATH (Debian: apt install chromium)")
    return found


def main() -> None:
    browser = chromium()
    with tempfile.TemporaryDirectory() as tmp:
        for name, (config, height) in PAGES.items():
            runs = Path(tmp) / name
            subprocess.run([sys.executable, "-m", "ampdoctor", "diagnose", config, "--out",
                            str(runs)], cwd=ROOT, capture_output=True, check=False)
            record = next(runs.glob("*.json"))
            page = Path(tmp) / f"{name}.html"
            subprocess.run([sys.executable, "-m", "ampdoctor", "report", str(record), "--html",
                            "-o", str(page)], cwd=ROOT, check=True, capture_output=True)
            subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                            "--disable-background-networking", "--disable-component-update",
                            "--disable-sync", "--no-first-run", "--hide-scrollbars",
                            f"--user-data-dir={Path(tmp) / 'profile'}",
                            f"--window-size={WIDTH},{height}",
                            f"--screenshot={HERE / (name + '.png')}", page.as_uri()],
                           check=True, capture_output=True, timeout=120)
            print(f"docs/screenshots/{name}.png  <- {config}")


if __name__ == "__main__":
    main()
