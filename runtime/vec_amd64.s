//go:build amd64 && !purego

#include "textflag.h"

// Vector loops for AVX2 and FMA, eight float32 lanes per YMM register, two
// registers per step. They handle the multiple of 8 of n that they are
// given; the Go callers (vec_amd64.go) do the rest.

// func axpyAVX(n int, a float32, x, y *float32)
// y[i] += a*x[i] for i < n (n a multiple of 8).
TEXT ·axpyAVX(SB), NOSPLIT, $0-32
	MOVQ n+0(FP), CX
	VBROADCASTSS a+8(FP), Y0
	MOVQ x+16(FP), SI
	MOVQ y+24(FP), DI

axpy16:
	CMPQ CX, $16
	JL   axpy8
	VMOVUPS (SI), Y1
	VMOVUPS 32(SI), Y2
	VFMADD213PS (DI), Y0, Y1
	VFMADD213PS 32(DI), Y0, Y2
	VMOVUPS Y1, (DI)
	VMOVUPS Y2, 32(DI)
	ADDQ $64, SI
	ADDQ $64, DI
	SUBQ $16, CX
	JMP  axpy16

axpy8:
	CMPQ CX, $8
	JL   axpydone
	VMOVUPS (SI), Y1
	VFMADD213PS (DI), Y0, Y1
	VMOVUPS Y1, (DI)

axpydone:
	VZEROUPPER
	RET

// func dotAVX(n int, x, y *float32) float32
// The sum of x[i]*y[i] for i < n (n a multiple of 8), in sixteen partial
// sums.
TEXT ·dotAVX(SB), NOSPLIT, $0-28
	MOVQ n+0(FP), CX
	MOVQ x+8(FP), SI
	MOVQ y+16(FP), DI
	VXORPS Y0, Y0, Y0
	VXORPS Y1, Y1, Y1

dot16:
	CMPQ CX, $16
	JL   dot8
	VMOVUPS (SI), Y2
	VMOVUPS 32(SI), Y3
	VFMADD231PS (DI), Y2, Y0
	VFMADD231PS 32(DI), Y3, Y1
	ADDQ $64, SI
	ADDQ $64, DI
	SUBQ $16, CX
	JMP  dot16

dot8:
	CMPQ CX, $8
	JL   dotsum
	VMOVUPS (SI), Y2
	VFMADD231PS (DI), Y2, Y0

dotsum:
	VADDPS Y1, Y0, Y0
	VEXTRACTF128 $1, Y0, X1
	VADDPS X1, X0, X0
	VHADDPS X0, X0, X0
	VHADDPS X0, X0, X0
	VMOVSS X0, ret+24(FP)
	VZEROUPPER
	RET

// SiLU in float64, four lanes per step: e = exp(-|x|) by range reduction
// (k = round(t·log2 e), r = t − k·ln 2 in two parts, a degree-11 Taylor
// polynomial, relative error below 1e-14, 2^k built in the exponent bits),
// σ = 1/(1+e) for x ≥ 0 and e/(1+e) for x < 0, then rounded once to
// float32 as the scalar loop does. |x| > 708 takes e = 0 (exp underflows
// in float64 there), so that −Inf gives NaN as x·σ(x) does.

DATA silu<>+0x00(SB)/8, $0x7fffffffffffffff // abs mask
DATA silu<>+0x08(SB)/8, $708.0
DATA silu<>+0x10(SB)/8, $-708.0
DATA silu<>+0x18(SB)/8, $1.4426950408889634 // log2 e
DATA silu<>+0x20(SB)/8, $6.93147180369123816490e-01 // ln2 hi
DATA silu<>+0x28(SB)/8, $1.90821492927058770002e-10 // ln2 lo
DATA silu<>+0x30(SB)/8, $6755399441055744.0 // 2^52 + 2^51
DATA silu<>+0x38(SB)/8, $1023
DATA silu<>+0x40(SB)/8, $1.0
DATA silu<>+0x48(SB)/8, $2.505210838544172e-08 // 1/11!
DATA silu<>+0x50(SB)/8, $2.755731922398589e-07 // 1/10!
DATA silu<>+0x58(SB)/8, $2.7557319223985893e-06 // 1/9!
DATA silu<>+0x60(SB)/8, $2.48015873015873e-05 // 1/8!
DATA silu<>+0x68(SB)/8, $0.0001984126984126984 // 1/7!
DATA silu<>+0x70(SB)/8, $0.001388888888888889 // 1/6!
DATA silu<>+0x78(SB)/8, $0.008333333333333333 // 1/5!
DATA silu<>+0x80(SB)/8, $0.041666666666666664 // 1/4!
DATA silu<>+0x88(SB)/8, $0.16666666666666666 // 1/3!
DATA silu<>+0x90(SB)/8, $0.5 // 1/2!
GLOBL silu<>(SB), RODATA|NOPTR, $0x98

// SIGMA4 leaves σ(x) of the four float64 lanes of Y0 in Y1; x stays in Y0.
// It uses Y2-Y5: Y2 = |x|, then t = max(−|x|, −708), then r; Y3 = k, then
// 2^k; Y5 = (|x| <= 708); Y1 = p(r), then e, then σ; Y4 the constants (1.0
// at the end).
#define SIGMA4 \
	VBROADCASTSD silu<>+0x00(SB), Y2 \
	VANDPD Y0, Y2, Y2 \
	VBROADCASTSD silu<>+0x08(SB), Y3 \
	VCMPPD $2, Y3, Y2, Y5 \
	VBROADCASTSD silu<>+0x10(SB), Y3 \
	VXORPD Y4, Y4, Y4 \
	VSUBPD Y2, Y4, Y2 \
	VMAXPD Y3, Y2, Y2 \
	VBROADCASTSD silu<>+0x18(SB), Y3 \
	VMULPD Y3, Y2, Y3 \
	VROUNDPD $0, Y3, Y3 \
	VBROADCASTSD silu<>+0x20(SB), Y4 \
	VFNMADD231PD Y4, Y3, Y2 \
	VBROADCASTSD silu<>+0x28(SB), Y4 \
	VFNMADD231PD Y4, Y3, Y2 \
	VBROADCASTSD silu<>+0x30(SB), Y4 \
	VADDPD Y4, Y3, Y3 \
	VPSUBQ Y4, Y3, Y3 \
	VPBROADCASTQ silu<>+0x38(SB), Y4 \
	VPADDQ Y4, Y3, Y3 \
	VPSLLQ $52, Y3, Y3 \
	VBROADCASTSD silu<>+0x48(SB), Y1 \
	VBROADCASTSD silu<>+0x50(SB), Y4 \
	VFMADD213PD Y4, Y2, Y1 \
	VBROADCASTSD silu<>+0x58(SB), Y4 \
	VFMADD213PD Y4, Y2, Y1 \
	VBROADCASTSD silu<>+0x60(SB), Y4 \
	VFMADD213PD Y4, Y2, Y1 \
	VBROADCASTSD silu<>+0x68(SB), Y4 \
	VFMADD213PD Y4, Y2, Y1 \
	VBROADCASTSD silu<>+0x70(SB), Y4 \
	VFMADD213PD Y4, Y2, Y1 \
	VBROADCASTSD silu<>+0x78(SB), Y4 \
	VFMADD213PD Y4, Y2, Y1 \
	VBROADCASTSD silu<>+0x80(SB), Y4 \
	VFMADD213PD Y4, Y2, Y1 \
	VBROADCASTSD silu<>+0x88(SB), Y4 \
	VFMADD213PD Y4, Y2, Y1 \
	VBROADCASTSD silu<>+0x90(SB), Y4 \
	VFMADD213PD Y4, Y2, Y1 \
	VBROADCASTSD silu<>+0x40(SB), Y4 \
	VFMADD213PD Y4, Y2, Y1 \
	VFMADD213PD Y4, Y2, Y1 \
	VMULPD Y3, Y1, Y1 \
	VANDPD Y5, Y1, Y1 \
	VADDPD Y4, Y1, Y2 \
	VDIVPD Y2, Y4, Y2 \
	VMULPD Y2, Y1, Y1 \
	VBLENDVPD Y0, Y1, Y2, Y1

// func siluAVX(n int, x, y *float32)
// y[i] = x[i]·σ(x[i]) for i < n (n a multiple of 4).
TEXT ·siluAVX(SB), NOSPLIT, $0-24
	MOVQ n+0(FP), CX
	MOVQ x+8(FP), SI
	MOVQ y+16(FP), DI

silu4:
	CMPQ CX, $4
	JL   siludone
	VCVTPS2PD (SI), Y0
	SIGMA4
	VMULPD Y1, Y0, Y1
	VCVTPD2PSY Y1, X1
	VMOVUPS X1, (DI)
	ADDQ $16, SI
	ADDQ $16, DI
	SUBQ $4, CX
	JMP  silu4

siludone:
	VZEROUPPER
	RET

// func siluGradAVX(n int, x, gy, d *float32)
// d[i] = gy[i]·σ(x)·(1 + x·(1 − σ(x))) for i < n (n a multiple of 4).
TEXT ·siluGradAVX(SB), NOSPLIT, $0-32
	MOVQ n+0(FP), CX
	MOVQ x+8(FP), SI
	MOVQ gy+16(FP), DX
	MOVQ d+24(FP), DI

silug4:
	CMPQ CX, $4
	JL   silugdone
	VCVTPS2PD (SI), Y0
	SIGMA4
	VBROADCASTSD silu<>+0x40(SB), Y4
	VSUBPD Y1, Y4, Y2 // 1 - σ
	VFMADD213PD Y4, Y0, Y2 // 1 + x(1-σ)
	VMULPD Y1, Y2, Y2
	VCVTPS2PD (DX), Y3
	VMULPD Y3, Y2, Y2 // g·σ·(1 + x(1−σ))
	VCVTPD2PSY Y2, X2
	VMOVUPS X2, (DI)
	ADDQ $16, SI
	ADDQ $16, DX
	ADDQ $16, DI
	SUBQ $4, CX
	JMP  silug4

silugdone:
	VZEROUPPER
	RET
