"""The user's arguments named in all-to-all size errors.

The core (``rust/algorithms/alltoallv.rs``, ``rust/desc.rs``) and the multi-node hierarchy
report a size disagreement in elements per peer ("rank 1 sends 3 elements to rank 0, which
expects 2 from it"), or the calls' descriptors when ranks chose different forms
(``alltoall``: no split sizes; ``alltoallv``: split sizes or tensor lists). Neither knows
which argument of the user's call those counts came from; :func:`name_arguments` adds that,
from the collective's name and the error's fields (:func:`..options.disagreement`), so every rank's
message is the same.
"""

from __future__ import annotations

__all__ = ["name_arguments"]


def name_arguments(name: str, exc: BaseException) -> str:
    """The message of ``exc``, raised by a failed ``name`` call (``all_to_all_single`` /
    ``alltoall_base``, or ``alltoall`` of tensor lists), with the arguments behind its counts
    named; other collectives' messages, and errors without disagreement fields, unchanged."""
    message = str(exc)
    single = name in ("all_to_all_single", "alltoall_base")
    if not single and name != "alltoall":
        return message
    kind = getattr(exc, "kind", None)
    if kind == "counts":
        p, q = exc.rank, exc.peer
        if single:
            return (f"{message} [rank {p}'s input_split_sizes[{q}] (an equal split of its input when it passed "
                    f"none) against rank {q}'s output_split_sizes[{p}] (an equal split of its output when it "
                    "passed none), counted in elements: rows x elements per row]")
        return f"{message} [rank {p}'s input_tensors[{q}].numel() against rank {q}'s output_tensors[{p}].numel()]"
    if single and kind == "calls" and any("alltoall" in str(k) for k in (exc.expected, exc.got)):
        return (f"{message} [alltoall: all_to_all_single without split sizes, sending input.numel() / world_size "
                "elements to each rank (output must have as many); alltoallv: with input_split_sizes / "
                "output_split_sizes (or all_to_all of tensor lists): every rank passes the same form, with "
                "sizes that match]")
    return message
