"""The thesis' published figures (ITIF, Table 5.2), the reference our results are set beside.

Latency in ms on an NVIDIA RTX A5000 (FasterTransformer), N tenants with one request each, text
at sequence 128 (BERT-base, ALBERT-large), ViT-base at 224x224x3. ``IMP`` is SEQ / ITIF as
printed. Copied from the thesis' Table 5.2 (``shared/reference/anchors.md``); the decoding rows
have no counterpart here (itif serves encoders).
"""

from __future__ import annotations

_COLS = ("SEQ", "MULTI-STREAM", "MPS", "ITIF", "IMP")


def _rows(*rows):
    return {int(r[0]): dict(zip(_COLS, r[1:])) for r in rows}


THESIS_TABLE_5_2: dict[str, dict[int, dict[str, float]]] = {
    "BERT": _rows((2, 6.90, 6.06, 5.14, 4.94, 1.39), (3, 9.95, 7.56, 7.03, 6.87, 1.44),
                  (4, 13.51, 10.68, 9.68, 8.94, 1.51), (5, 16.22, 12.32, 12.43, 11.01, 1.47)),
    "ALBERT": _rows((2, 17.04, 14.61, 14.2, 7.82, 2.17), (3, 24.23, 19.62, 20.22, 10.63, 2.27),
                    (4, 33.98, 24.72, 26.43, 14.14, 2.40), (5, 41.26, 30.12, 33.5, 22.05, 1.87)),
    "ViT": _rows((2, 9.92, 8.26, 9.28, 5.05, 1.96), (3, 14.19, 11.92, 13.71, 7.08, 2.04),
                 (4, 19.21, 16.21, 18.28, 11.21, 1.71), (5, 23.41, 18.21, 22.55, 15.36, 1.52)),
    "DECODING": _rows((2, 46.10, 32.74, 30.06, 24.38, 1.44),
                      (3, 70.13, 57.13, 50.88, 40.48, 1.73),
                      (4, 94.42, 82.32, 78.31, 54.21, 1.74),
                      (5, 117.77, 101.82, 95.32, 70.30, 1.67)),
}
THESIS_DEVICE = "NVIDIA RTX A5000 (FasterTransformer)"
THESIS_MODELS = {"BERT": "bert-base", "ALBERT": "albert-large", "ViT": "vit-base"}


def thesis_family(model: str) -> str | None:
    """The thesis' row family of one of our presets (``bert-tiny`` -> ``BERT``)."""
    from itif.backbones.spec import load_spec  # noqa: PLC0415

    try:
        fam = load_spec(model).family
    except Exception:  # noqa: BLE001 - a checkpoint path that is gone: no thesis row
        return None
    return {"bert": "BERT", "albert": "ALBERT", "vit": "ViT"}.get(fam)
