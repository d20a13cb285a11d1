"""What a prefetch is asked for: PackSpec and the validated PrefetchOptions that decide every request and batch."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from tokenizer_client._inputs import flag, integer, set_flags, set_integer
from tokenizer_client._requests import PackOptions, TokenizeOptions
from tokenizer_client._retry import RetryPolicy
from tokenizer_client._torch import check_torch


@dataclass(frozen=True)
class PackSpec:
    """Pack the stream into batches of ``rows`` rows of exactly ``seq_len`` tokens.

    ``concat`` (no padding; documents run across rows and batches) or ``best_fit`` (whole documents,
    pieces of at most ``seq_len``, padded; each request of ``batch_size`` texts packs on its own).
    ``add_eos``/``add_bos`` mark document boundaries in the ids (``add_eos`` unset: True for texts; conversations
    and records leave both unset, their chat template decides the special tokens); ``mask_document_start`` sets the
    label of each document's first token to -100. Conversations' and records' labels are also -100 wherever their
    loss mask is 0 (the user's turns, the template's headers, the prompt). The last batch may have fewer than
    ``rows`` rows (as DataLoader's ``drop_last=False``); ``drop_last=True`` drops it. Concat rows are never padded:
    the stream's last tokens that fill no row are the prefetcher's ``leftover``. A stream that packs
    into no batch at all warns (``UserWarning``) saying why.
    """

    seq_len: int
    rows: int
    strategy: Literal["concat", "best_fit"] = "concat"
    add_eos: bool | None = None  # None: True for texts (an EOS after each document), unset for conversations
    add_bos: bool = False
    mask_document_start: bool = False
    drop_last: bool = False

    def __post_init__(self) -> None:
        # Numpy integers and bools become Python values (the state_dict stays plain JSON); floats are refused.
        set_integer(self, "seq_len", minimum=2)
        set_integer(self, "rows", minimum=1)
        set_flags(self, "add_bos", "mask_document_start", "drop_last")
        if self.add_eos is not None:
            set_flags(self, "add_eos")
        if self.strategy not in ("concat", "best_fit"):
            raise ValueError(f"strategy must be 'concat' or 'best_fit', got {self.strategy!r}")


@dataclass(frozen=True)
class PrefetchOptions:
    """Everything that decides what a prefetcher requests and hands out (validated once, by ``build``)."""

    batch_size: int
    depth: int
    tokenize: TokenizeOptions  # with pack=, the PackSpec's add_bos/add_eos
    pack: PackSpec | None
    as_torch: bool
    pin_memory: bool
    retry: RetryPolicy

    @classmethod
    def build(
        cls,
        batch_size: int,
        depth: int,
        tokenize: TokenizeOptions,
        pack: PackSpec | None,
        as_torch: bool,
        pin_memory: bool,
        retry: RetryPolicy,
    ) -> PrefetchOptions:
        """Called by the clients' ``prefetch``, in the caller's thread (a missing torch fails there)."""
        batch_size = integer(batch_size, "batch_size", minimum=1)
        depth = integer(depth, "depth", minimum=1)
        as_torch, pin_memory = flag(as_torch, "as_torch"), flag(pin_memory, "pin_memory")
        if pack is not None and not isinstance(pack, PackSpec):
            raise TypeError(f"pack takes a PackSpec(seq_len=..., rows=...), not {type(pack).__name__} {pack!r}")
        bare = TokenizeOptions(
            tokenize.model,
            parse_special_tokens=tokenize.parse_special_tokens,
            inputs=tokenize.inputs,
            train_on=tokenize.train_on,
        )
        if tokenize.inputs != "conversations" and tokenize.train_on != "assistant":
            raise ValueError("train_on applies to conversations only (conversations=True, or an iterable of them)")
        if tokenize.inputs != "texts" and (
            tokenize != bare or (pack is not None and (pack.add_bos or pack.add_eos is not None))
        ):
            raise ValueError(
                f"add_bos, add_eos, max_length and sample cannot be used with {tokenize.inputs}: the chat "
                "template (for records, TRL's rule) decides the special tokens, and a truncated conversation "
                "would train on a cut turn"
            )
        if pack is not None:
            if tokenize != bare:
                raise ValueError(
                    "with pack=, set add_bos/add_eos on the PackSpec; max_length and sample do not apply to packing"
                )
            if tokenize.inputs == "texts":
                tokenize = replace(tokenize, add_bos=pack.add_bos, add_eos=pack.add_eos is not False)
        if pin_memory and not as_torch:
            raise ValueError("pin_memory=True needs as_torch=True")
        if as_torch:
            pin_memory = check_torch(pin_memory)
        return cls(batch_size, depth, tokenize, pack, as_torch, pin_memory, retry)

    def pack_options(self) -> PackOptions:
        """What each best_fit window's /v1/pack request asks for."""
        assert self.pack is not None
        spec, tokenize = self.pack, self.tokenize
        return PackOptions(
            spec.seq_len,
            "best_fit",
            tokenize.model,
            tokenize.add_bos,
            tokenize.add_eos,
            spec.mask_document_start,
            tokenize.parse_special_tokens,
            tokenize.inputs,
            tokenize.train_on,
        )

    # The tokenize options as attributes of their own, as before they were gathered in `tokenize`.
    model = property(lambda self: self.tokenize.model)
    add_bos = property(lambda self: self.tokenize.add_bos)
    add_eos = property(lambda self: self.tokenize.add_eos)
    max_length = property(lambda self: self.tokenize.max_length)
    sample = property(lambda self: self.tokenize.sample)
    inputs = property(lambda self: self.tokenize.inputs)

    @property
    def mode(self) -> str:
        return "ragged" if self.pack is None else self.pack.strategy

    def fingerprint(self) -> dict[str, Any]:
        """The options a resumed run must repeat to produce the same ids."""
        options: dict[str, Any] = asdict(self.tokenize)
        # texts: as states were saved before conversations came (so those states still resume); records: no train_on
        if options["inputs"] == "texts":
            del options["inputs"], options["train_on"]
        elif options["inputs"] == "records":
            del options["train_on"]
        if self.pack is not None:
            options.update(seq_len=self.pack.seq_len, mask_document_start=self.pack.mask_document_start)
        if self.mode == "best_fit":
            options["batch_size"] = self.batch_size  # best-fit rows depend on which texts share a request
        return options
