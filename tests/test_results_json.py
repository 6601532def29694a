"""Every committed result file in docs/results is standard JSON (no Infinity / NaN tokens, which
strict parsers reject); an infinite perplexity is written ``null``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).parents[1] / "docs" / "results"


def _refuse(token: str) -> None:
    raise ValueError(f"non-standard JSON token {token}")


@pytest.mark.parametrize("path", sorted(RESULTS.rglob("*.json")), ids=lambda p: str(p.relative_to(RESULTS)))
def test_committed_result_file_is_strict_json(path: Path) -> None:
    json.loads(path.read_text(), parse_constant=_refuse)


def test_the_strict_parse_rejects_infinity() -> None:
    with pytest.raises(ValueError, match="Infinity"):
        json.loads('{"knn_only_ppl": Infinity}', parse_constant=_refuse)
