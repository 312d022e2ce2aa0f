"""``FLAGOS_SHM_PLAN``'s text: a word or explicit thresholds (the package docstring)."""

from __future__ import annotations

import re
from typing import Optional

from ... import config
from .keys import FALLBACK, KEYS, SINGLE_COPY_KEYS, SINGLE_COPY_MAX_KEYS, SIZE_LIMIT, describe


def _bytes(text: str, what: str) -> Optional[int]:
    if text.strip().lower() in ("never", "none", "inf"):
        return None
    m = re.fullmatch(r"\s*([0-9]+)\s*([KMG]?)(?:i?B)?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"{config.ENV_PLAN}: {what}={text!r}: expected bytes (e.g. 262144, 256K, 2M) or 'never'")
    if len(m.group(1).lstrip("0")) > 20:  # more than 64 bits whatever the suffix (and int() has a digit limit)
        raise ValueError(f"{config.ENV_PLAN}: {what}={text.strip()[:40]!r}...: too large for the core's 64-bit sizes")
    value = int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2).upper()]
    if value >= SIZE_LIMIT:
        raise ValueError(f"{config.ENV_PLAN}: {what}={text!r}: {value} bytes do not fit the core's 64-bit sizes")
    return value


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
        plan[key] = _bytes(value, name.strip())
    for lo, hi in zip(SINGLE_COPY_KEYS, SINGLE_COPY_MAX_KEYS):
        if plan[lo] is not None and plan[hi] is not None and plan[hi] <= plan[lo]:
            raise ValueError(f"{config.ENV_PLAN}={text!r}: {hi}={plan[hi]} is not above {lo}={plan[lo]} (a band "
                             "from the first up to below the second; missing keys take the fallback's values, "
                             f"{describe(FALLBACK)})")
    if plan["one_shot_max_bytes"] is None:
        plan["one_shot_max_bytes"] = 1 << 62
    return plan
