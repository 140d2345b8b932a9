// RotaryEmbeddingGrad (rotation by minus the angle), bf16.
#include "../rope_entry.h"
ROPE_ENTRY(rope_ops_rotary_embedding_grad_bf16, bfloat16_t, true)
