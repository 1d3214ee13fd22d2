"""What handing a prompt's KV from a prefill engine to a decode engine costs, at GPU scale.

- copy (paged): every byte of the prompt's KV crosses the link between the two GPUs once, at the link's one-way
  peak (gpu_figures.LINKS: NVLink 4 450 GB/s, PCIe Gen5 x16 64 GB/s, NVIDIA's figures): bytes / bandwidth.
- remap (vmm): no byte moves; the decode engine maps the prompt's physical pages into its slot, one cuMemMap per
  page and one cuMemSetAccess per tensor's contiguous run (the vmm cost model of serve/costs.py, whose per-call
  figures are kvcached's A100 measurements). That is the handoff's latency. The prefill engine then unmaps the
  given pages and maps fresh ones into the slot for its next prompt: one cuMemUnmap and one cuMemMap per page and
  one cuMemSetAccess per tensor, charged to the prefill GPU's clock, off the request's path.

A vmm page holds `tokens_per_page` tokens of one tensor (one layer's K or V), so a context of T tokens spans
ceil(T / tokens_per_page) pages in each of the 2 x layers tensors."""
from __future__ import annotations

from dataclasses import dataclass

from kvlab.experiments.sim.gpu_figures import Link
from kvlab.experiments.sim.roofline import ModelSpec
from kvlab.experiments.sim.serve.costs import DriverProfile


def kv_bytes(tokens: int, model: ModelSpec) -> int:
    return tokens * model.kv_bytes_per_token


def copy_seconds(tokens: int, model: ModelSpec, link: Link) -> float:
    return kv_bytes(tokens, model) / link.bytes_per_s


def tensors(model: ModelSpec) -> int:
    return 2 * model.shard.num_layers


def tokens_per_page(page_size: int, model: ModelSpec) -> int:
    """Tokens of one tensor (one layer's K or V) a page holds."""
    return page_size // (model.kv_bytes_per_token // tensors(model))


def pages(tokens: int, page_size: int, model: ModelSpec) -> int:
    return -(-tokens // tokens_per_page(page_size, model)) * tensors(model)


def remap_seconds(tokens: int, page_size: int, model: ModelSpec, costs: DriverProfile) -> float:
    """The decode side: a map per page, an access grant per tensor."""
    return pages(tokens, page_size, model) * costs.map_s + tensors(model) * costs.set_access_s


def release_seconds(tokens: int, page_size: int, model: ModelSpec, costs: DriverProfile) -> float:
    """The prefill side, after the handoff: unmap the given pages, map fresh ones for the next prompt."""
    return pages(tokens, page_size, model) * (costs.unmap_s + costs.map_s) + tensors(model) * costs.set_access_s


@dataclass(frozen=True, slots=True)
class Handoff:
    """How one setup hands KV over: `link` for a copy, else a remap with `page_size` pages and `costs`."""
    model: ModelSpec
    link: Link | None = None
    page_size: int = 0
    costs: DriverProfile | None = None

    def seconds(self, tokens: int) -> float:
        """On the request's path, from the prefill's first token to the decode engine holding the KV."""
        if self.link is not None:
            return copy_seconds(tokens, self.model, self.link)
        return remap_seconds(tokens, self.page_size, self.model, self.costs)

    def sender_seconds(self, tokens: int) -> float:
        """Charged to the prefill GPU after the handoff (0 for a copy: the copy engines move the bytes)."""
        if self.link is not None:
            return 0.0
        return release_seconds(tokens, self.page_size, self.model, self.costs)

    def bytes_copied(self, tokens: int) -> int:
        return kv_bytes(tokens, self.model) if self.link is not None else 0

    def units_moved(self, tokens: int) -> int:
        """Pages remapped (vmm); for a copy, 0 (the bytes are the measure)."""
        return 0 if self.link is not None else pages(tokens, self.page_size, self.model)
