// The fused prologue's backward (grad of qkv and of the norm weights), bf16.
#include "../rope_entry.h"
ROPE_PROLOGUE_GRAD_ENTRY(rope_ops_qkv_prologue_grad_bf16, bfloat16_t)
