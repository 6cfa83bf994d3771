// Strided index geometry shared by broadcast.cu and layout.cu: a flat
// index over at most four dimensions (d0 implied by the element count)
// split by fdiv, and its offsets into three strided tensors (the result's
// so, the operands' sa and sb; zero strides broadcast). The host collapses
// every walk to its fewest dimensions first (broadcast.go).
#pragma once

#include "common.cuh"

struct bgeo {
	unsigned d1, m1, s1, d2, m2, s2, d3, m3, s3;
	i64 so0, so1, so2, so3, sa0, sa1, sa2, sa3, sb0, sb1, sb2, sb3;
};

// bsplit writes the offsets of flat index v (< 2^31) into the result and
// both operands.
DEV void bsplit(const bgeo& g, unsigned v, i64* o, i64* ia, i64* ib) {
	unsigned q3 = fdiv(v, g.m3, g.s3), i3 = v - q3 * g.d3;
	unsigned q2 = fdiv(q3, g.m2, g.s2), i2 = q3 - q2 * g.d2;
	unsigned i0 = fdiv(q2, g.m1, g.s1), i1 = q2 - i0 * g.d1;
	*o = i0 * g.so0 + i1 * g.so1 + i2 * g.so2 + i3 * g.so3;
	*ia = i0 * g.sa0 + i1 * g.sa1 + i2 * g.sa2 + i3 * g.sa3;
	*ib = i0 * g.sb0 + i1 * g.sb1 + i2 * g.sb2 + i3 * g.sb3;
}

// The geometry's parameters are written out in each kernel's declaration
// (the tests read the declarations); BGEO gathers them.
#define BGEO {d1, m1, s1, d2, m2, s2, d3, m3, s3, so0, so1, so2, so3, sa0, sa1, sa2, sa3, sb0, sb1, sb2, sb3}
