"""What handing a prompt's KV from a prefill engine to a decode engine costs, at GPU scale (docs/disaggregation.md).

Two arrangements:
- same-device: the prefill and the decode process share one GPU's memory. vmm hands the prompt over by `remap`:
  the decode process maps the prompt's physical pages into its slot (a cuMemMap per page, a cuMemSetAccess per
  page or per contiguous run): no byte moves. paged copies its blocks device to device (`copy`, read and write at
  the GPU's memory bandwidth).
- cross-device: the pages are on the prefill GPU. vmm either `copy`s them (one contiguous range per tensor: few,
  large transfers over the link) or maps them `remote` (the decode GPU maps the prefill GPU's pages, then reads
  the prompt's KV over the link on every decode step: run.py's RemoteReadTap). paged `copy`s its blocks: one
  transfer per block per tensor (many small ones).

A copy takes bytes / the link's one-way peak (gpu_figures.LINKS) + transfers x `transfer_overhead_s` (0 unless
given: no source gives a per-transfer cost yet; the GPU check's handoff part measures it). The prefill side then
unmaps the given pages and maps fresh ones for its next prompt (vmm remap and copy); with background mapping it
defers the unmaps and maps ahead (vAttention's step_async), off the GPU's clock.

A vmm page holds `tokens_per_page` tokens of one tensor: one layer's K or V per-layer, every layer's K or V
cross-layer (sim/layouts.py)."""
from __future__ import annotations

from dataclasses import dataclass

from kvlab.experiments.sim.gpu_figures import Link
from kvlab.experiments.sim.layouts import tensors as layout_tensors
from kvlab.experiments.sim.layouts import tokens_per_page as layout_tokens_per_page
from kvlab.experiments.sim.roofline import ModelSpec
from kvlab.experiments.sim.serve.costs import DriverProfile

KINDS = ("copy", "remap", "remote")


def kv_bytes(tokens: int, model: ModelSpec) -> int:
    return tokens * model.kv_bytes_per_token


def copy_seconds(tokens: int, model: ModelSpec, link: Link) -> float:
    return kv_bytes(tokens, model) / link.bytes_per_s


def tensors(model: ModelSpec, layout: str = "per-layer") -> int:
    return layout_tensors(model, layout)


def tokens_per_page(page_size: int, model: ModelSpec, layout: str = "per-layer") -> int:
    """Tokens of one tensor a page holds."""
    return layout_tokens_per_page(page_size, model, layout)


def pages(tokens: int, page_size: int, model: ModelSpec, layout: str = "per-layer") -> int:
    return -(-tokens // tokens_per_page(page_size, model, layout)) * tensors(model, layout)


def grants(tokens: int, page_size: int, model: ModelSpec, set_access: str, layout: str = "per-layer") -> int:
    """cuMemSetAccess calls to map a prompt: one per page, or one per tensor's contiguous run."""
    return pages(tokens, page_size, model, layout) if set_access == "per-page" else tensors(model, layout)


def remap_seconds(tokens: int, page_size: int, model: ModelSpec, costs: DriverProfile, set_access: str = "per-run",
                  layout: str = "per-layer") -> float:
    """The decode side: a map per page, access grants per page or per tensor."""
    return (pages(tokens, page_size, model, layout) * costs.map_s
            + grants(tokens, page_size, model, set_access, layout) * costs.set_access_s)


def release_seconds(tokens: int, page_size: int, model: ModelSpec, costs: DriverProfile, set_access: str = "per-run",
                    layout: str = "per-layer") -> float:
    """The prefill side, after the handoff: unmap the given pages, map fresh ones for the next prompt."""
    return (pages(tokens, page_size, model, layout) * costs.unmap_s
            + remap_seconds(tokens, page_size, model, costs, set_access, layout))


@dataclass(frozen=True, slots=True)
class Handoff:
    """How one setup hands KV over. `kind`: copy (over `link`; `block_size` tokens a transfer for paged, one
    contiguous range per tensor for vmm), remap (same device, zero-copy) or remote (cross-device vmm: map the
    remote pages; reads are charged per decode step). vmm handoffs carry `page_size`, `costs` and `layout`."""
    model: ModelSpec
    link: Link | None = None
    page_size: int = 0
    costs: DriverProfile | None = None
    kind: str = ""                     # "" = copy when a link is given, else remap (the older constructor)
    block_size: int = 0                # paged: tokens per block (one transfer per block per tensor)
    layout: str = "per-layer"
    set_access: str = "per-run"
    background: bool = False           # the prefill side defers unmaps and maps ahead (off its clock)
    transfer_overhead_s: float = 0.0

    @property
    def how(self) -> str:
        return self.kind or ("copy" if self.link is not None else "remap")

    def transfers(self, tokens: int) -> int:
        """Copies issued: one per block per tensor (paged), one per tensor (vmm's contiguous ranges)."""
        if self.how != "copy":
            return 0
        if self.block_size:
            return -(-tokens // self.block_size) * tensors(self.model)
        return tensors(self.model, self.layout) if self.page_size else 1

    def seconds(self, tokens: int) -> float:
        """On the request's path, from the prefill's first token to the decode engine holding the KV."""
        if self.how == "copy":
            return copy_seconds(tokens, self.model, self.link) + self.transfers(tokens) * self.transfer_overhead_s
        return remap_seconds(tokens, self.page_size, self.model, self.costs, self.set_access, self.layout)

    def sender_seconds(self, tokens: int) -> float:
        """Charged to the prefill GPU after the handoff: vmm's unmap and map-ahead, unless background mapping hides
        them (0 for paged: the copy engines move the bytes, the blocks go back to the free list)."""
        if not self.page_size or self.background or self.how == "remote":
            return 0.0
        return release_seconds(tokens, self.page_size, self.model, self.costs, self.set_access, self.layout)

    def hidden_sender_seconds(self, tokens: int) -> float:
        """The prefill side's driver time that background mapping ran off its clock."""
        if not self.page_size or not self.background or self.how == "remote":
            return 0.0
        return release_seconds(tokens, self.page_size, self.model, self.costs, self.set_access, self.layout)

    def bytes_copied(self, tokens: int) -> int:
        return kv_bytes(tokens, self.model) if self.how == "copy" else 0

    def units_moved(self, tokens: int) -> int:
        """Pages remapped or mapped remotely (vmm); for a copy, 0 (bytes and transfers are the measure)."""
        return 0 if self.how == "copy" else pages(tokens, self.page_size, self.model, self.layout)
