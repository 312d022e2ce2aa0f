"""``FLAGOS_SHM_PLAN``'s text: a word or explicit thresholds (the package docstring)."""

from __future__ import annotations

from ... import config
from .keys import FALLBACK, KEYS, SINGLE_COPY_KEYS, SINGLE_COPY_MAX_KEYS, describe


def parse(text: str):
    """``FLAGOS_SHM_PLAN`` -> ``"auto"``, ``"calibrate"``, ``"fallback"`` or a plan dict.

    Raises:
        ValueError: unknown word or key, malformed value (the message names the variable).
    """
    word = text.strip().lower()
    if word in ("", "auto"):
        return "auto"
    if word in ("calibrate", "fallback"):
        return word
    if word == "default":
        return "fallback"
    plan = dict(FALLBACK)
    short = {k.replace("_min_bytes", "").replace("_bytes", ""): k for k in KEYS}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, value = item.partition("=")
        key = short.get(name.strip(), name.strip())
        if not sep or key not in KEYS:
            raise ValueError(f"{config.ENV_PLAN}={text!r}: {item!r}: expected auto, calibrate, fallback or "
                             f"key=value pairs with keys {', '.join(short)}")
        plan[key] = config.parse_bytes(value, f"{config.ENV_PLAN}: {name.strip()}", never=True, suffix=True)
    for lo, hi in zip(SINGLE_COPY_KEYS, SINGLE_COPY_MAX_KEYS):
        if plan[lo] is not None and plan[hi] is not None and plan[hi] <= plan[lo]:
            raise ValueError(f"{config.ENV_PLAN}={text!r}: {hi}={plan[hi]} is not above {lo}={plan[lo]} (a band "
                             "from the first up to below the second; missing keys take the fallback's values, "
                             f"{describe(FALLBACK)})")
    if plan["one_shot_max_bytes"] is None:
        plan["one_shot_max_bytes"] = 1 << 62
    return plan
