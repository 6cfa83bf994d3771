package pth

// crc32Combine returns the CRC-32 (IEEE) of A followed by B from crcA,
// crcB and len(B), without reading either: CRC is linear over GF(2), and
// appending n bytes multiplies by x^(8n) modulo the polynomial (zlib's
// crc32_combine). A copy that checks its input's CRC and computes its
// output's, where the two differ only in a few ranges, then reads each
// byte once.
func crc32Combine(crcA, crcB uint32, lenB int64) uint32 {
	if lenB <= 0 {
		return crcA
	}
	var even, odd [32]uint32
	odd[0] = 0xedb88320 // the operator for one zero bit
	row := uint32(1)
	for n := 1; n < 32; n++ {
		odd[n] = row
		row <<= 1
	}
	gf2Square(&even, &odd) // two zero bits
	gf2Square(&odd, &even) // four
	for {
		gf2Square(&even, &odd)
		if lenB&1 != 0 {
			crcA = gf2Times(&even, crcA)
		}
		lenB >>= 1
		if lenB == 0 {
			break
		}
		gf2Square(&odd, &even)
		if lenB&1 != 0 {
			crcA = gf2Times(&odd, crcA)
		}
		lenB >>= 1
		if lenB == 0 {
			break
		}
	}
	return crcA ^ crcB
}

func gf2Times(m *[32]uint32, v uint32) uint32 {
	var sum uint32
	for i := 0; v != 0; i, v = i+1, v>>1 {
		if v&1 != 0 {
			sum ^= m[i]
		}
	}
	return sum
}

func gf2Square(sq, m *[32]uint32) {
	for n := 0; n < 32; n++ {
		sq[n] = gf2Times(m, m[n])
	}
}
