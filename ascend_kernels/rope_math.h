// rope_ops Ascend C kernels: cos/sin of an angle given as a 32-bit fraction of a turn.
//
// Used for positions outside the cos/sin table. The angle of position p for frequency i is the
// wrapping 64-bit product p * freq_turns[i], a fraction of a turn that is exact arithmetic modulo
// one turn for every int64 p (no overflow, no float product); its top 32 bits are the angle in
// turns times 2^32 (truncated: at most 2^-32 turn low). rope_ops' freq_turns are within 2^-65 turn
// of the true frequency, so the angle handed to rope_sincos_turns is within |p| * 2^-65 + 2^-32
// turn of exact: under 2^-24 turn (3.7e-7 rad) for every |p| < 2^40.
// Range reduction is done on that integer, exactly: the nearest quarter turn q and a remainder in
// [-1/8, 1/8) turn. The remainder becomes a float angle in [-pi/4, pi/4) (one rounding, relative
// 2^-24) and short Taylor polynomials give sin and cos with truncation error below 2e-9; cos and
// sin come out within 3e-7 of exact (tests/test_ascend_kernel_sim.py samples the turn). Only scalar
// float arithmetic: it runs on the AI core's scalar unit and, in the CPU emulation, as plain C++.
#ifndef ROPE_OPS_ASCEND_ROPE_MATH_H
#define ROPE_OPS_ASCEND_ROPE_MATH_H

#include <stdint.h>

#ifndef __aicore__
#define __aicore__
#endif

// top: the angle as a signed 32-bit fraction of a turn. Writes m*cos and m*sin.
__aicore__ inline void rope_sincos_turns(int32_t top, float m, float* c, float* s)
{
    uint32_t u = (uint32_t)top;
    uint32_t quarter = (u + 0x20000000u) >> 30;                    // nearest quarter turn, 0..3
    int32_t rem = (int32_t)(u - (quarter << 30));                  // in [-2^29, 2^29)
    const float kTurnToRad = 1.4629180792671596e-09f;             // 2*pi / 2^32
    float a = (float)rem * kTurnToRad;                             // in [-pi/4, pi/4)
    float a2 = a * a;
    float sp = a * (1.0f + a2 * (-1.0f / 6.0f + a2 * (1.0f / 120.0f + a2 * (-1.0f / 5040.0f +
               a2 * (1.0f / 362880.0f)))));
    float cp = 1.0f + a2 * (-0.5f + a2 * (1.0f / 24.0f + a2 * (-1.0f / 720.0f + a2 * (1.0f / 40320.0f +
               a2 * (-1.0f / 3628800.0f)))));
    float cr, sr;
    if (quarter == 0) { cr = cp; sr = sp; }
    else if (quarter == 1) { cr = -sp; sr = cp; }
    else if (quarter == 2) { cr = -cp; sr = -sp; }
    else { cr = sp; sr = -cp; }
    *c = cr * m;
    *s = sr * m;
}

// Position p times the fixed-point frequency, top 32 bits (wrapping arithmetic, no UB in C++).
__aicore__ inline int32_t rope_turns_top(int64_t p, int64_t freqTurns)
{
    uint64_t prod = (uint64_t)p * (uint64_t)freqTurns;
    return (int32_t)(uint32_t)(prod >> 32);
}

#endif  // ROPE_OPS_ASCEND_ROPE_MATH_H
