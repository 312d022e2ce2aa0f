"""``FLAGOS_SHM_PLAN``'s text: a word or explicit thresholds (the package docstring)."""

from __future__ import annotations

from ... import config
from .keys import FALLBACK, KEYS, SINGLE_COPY_KEYS, SINGLE_COPY_MAX_KEYS, describe


#: The shorthand key that sets every collective's single-copy band at once: ``single_copy=N``
#: is ``<collective>_single_copy=N`` with no end (``_single_copy_max=never``) for each of
#: :data:`SINGLE_COPY_KEYS`, before the pairs that name one collective (which override it).
#: It replaces the retired ``FLAGOS_SHM_CMA_MIN_BYTES``.
ALL_SINGLE_COPY = "single_copy"


def parse(text: str):
    """``FLAGOS_SHM_PLAN`` -> ``"auto"``, ``"calibrate"``, ``"fallback"`` or a plan dict.

    Explicit thresholds are ``key=value`` pairs separated by commas: the keys of
    :data:`KEYS`, short names without ``_min_bytes``/``_bytes`` allowed, and
    :data:`ALL_SINGLE_COPY`; values in bytes (``262144``, ``256K``, ``2M``) or ``never``.
    Keys not given take the fallback's values.

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
    pairs = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, value = item.partition("=")
        key = short.get(name.strip(), name.strip())
        if not sep or key not in (*KEYS, ALL_SINGLE_COPY):
            raise ValueError(f"{config.ENV_PLAN}={text!r}: {item!r}: expected auto, calibrate, fallback or "
                             f"key=value pairs with keys {', '.join(short)}, {ALL_SINGLE_COPY}")
        pairs.append((key, config.parse_bytes(value, f"{config.ENV_PLAN}: {name.strip()}", never=True, suffix=True)))
    for key, value in sorted(pairs, key=lambda kv: kv[0] != ALL_SINGLE_COPY):  # the shorthand first
        if key == ALL_SINGLE_COPY:
            plan.update(dict.fromkeys(SINGLE_COPY_KEYS, value))
            plan.update(dict.fromkeys(SINGLE_COPY_MAX_KEYS))  # None: no end
        else:
            plan[key] = value
    for lo, hi in zip(SINGLE_COPY_KEYS, SINGLE_COPY_MAX_KEYS):
        if plan[lo] is not None and plan[hi] is not None and plan[hi] <= plan[lo]:
            raise ValueError(f"{config.ENV_PLAN}={text!r}: {hi}={plan[hi]} is not above {lo}={plan[lo]} (a band "
                             "from the first up to below the second; missing keys take the fallback's values, "
                             f"{describe(FALLBACK)})")
    if plan["one_shot_max_bytes"] is None:
        plan["one_shot_max_bytes"] = 1 << 62
    return plan
