// The fused prologue's backward (grad of qkv and of the norm weights), fp32.
#include "../rope_entry.h"
ROPE_PROLOGUE_GRAD_ENTRY(rope_ops_qkv_prologue_grad_fp32, float)
