"""`ampdoctor schema`: the spec's JSON Schema on stdout."""

from __future__ import annotations

import json
import sys


def schema() -> None:
    """Print the spec's JSON Schema (for editors: the YAML language server completes and checks
    spec keys with it)."""
    from ..spec import json_schema
    sys.stdout.write(json.dumps(json_schema(), indent=2) + "\n")
