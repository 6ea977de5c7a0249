"""Sokoban (6x6, one box): `configs/sokoban.py[:cpu|:tiny]`.

Validation runs on SimpleSokoban; add the reference's generalisation probes with
`--config.val.tags=SimpleSokoban,LargerSokoban,SokobanDifferentGridVocab`.
"""

from configs import common


def get_config(arg=None):
    v = common.variant(arg, ("cpu", "tiny"))
    c = common.base("SimpleSokoban")
    if v == "cpu":
        common.cpu(c)
    elif v == "tiny":
        common.tiny(c)
    c.lock()
    return c
