"""The paged layout's attention kernels as the paged backend declares them (its spec names `declare`): each
implementation by "module:function", imported only when the dispatcher chooses it, with the rules of the library
it wraps (common/attention/rules.py)."""
from __future__ import annotations

from kvlab.common.attention import rules
from kvlab.common.attention.declarations import KernelDecl
from kvlab.common.attention.rules import Environment


def declare(env: Environment) -> list[KernelDecl]:
    """`env` says which packages count as installed (a study may simulate other machines)."""
    installed = env.installed
    return [
        KernelDecl("torch_paged", "paged", "kvlab.paged.kernels.torch_ref:paged_attention_torch",
                   description="gather by block table into a buffer, then SDPA", check=rules.torch_rules),
        KernelDecl("triton_paged", "paged", "kvlab.paged.kernels.triton_paged:paged_attention_triton",
                   package="triton", installed=installed, check=rules.triton_rules(env),
                   phase_check=rules.triton_phase_rules,
                   description="kvlab's Triton paged attention (decode and prefill with past context)"),
        KernelDecl("flash_attn_paged", "paged", "kvlab.paged.kernels.flash_attn:paged_attention_flash_attn",
                   package="flash_attn", installed=installed, check=rules.flash_attn_paged_rules,
                   phase_check=rules.flash_attn_paged_phase_rules,
                   description="flash_attn_with_kvcache / flash_attn_varlen_func with block_table"),
        KernelDecl("flashinfer_paged", "paged", "kvlab.paged.kernels.flashinfer:paged_attention_flashinfer",
                   package="flashinfer", installed=installed, check=rules.flashinfer_rules,
                   description="FlashInfer BatchPrefill/BatchDecodeWithPagedKVCacheWrapper"),
        KernelDecl("flex_paged", "paged", "kvlab.paged.kernels.flex:paged_attention_flex",
                   package="torch.nn.attention.flex_attention", installed=installed, check=rules.flex_rules,
                   description="torch FlexAttention with a paged BlockMask"),
    ]
