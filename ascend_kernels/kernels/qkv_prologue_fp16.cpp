// The fused prologue (QKV split + RMSNorm + RoPE + KV-cache write), fp16.
#include "../rope_entry.h"
ROPE_PROLOGUE_ENTRY(rope_ops_qkv_prologue_fp16, half)
