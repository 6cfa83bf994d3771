package pth

import "sync"

// crc32Combine returns the CRC-32 (IEEE) of A followed by B from crcA,
// crcB and len(B), without reading either: CRC is linear over GF(2), and
// appending n bytes multiplies by x^(8n) modulo the polynomial (zlib's
// crc32_combine). A copy that checks its input's CRC and computes its
// output's, where the two differ only in a few ranges, then reads each
// byte once.
func crc32Combine(crcA, crcB uint32, lenB int64) uint32 {
	// The shift is linear: a zero CRC shifts to zero, so the first chunk of
	// every record (most records are one chunk) costs nothing; and the
	// shift by a whole copy chunk, met again and again, is a cached matrix.
	switch {
	case lenB <= 0 || crcA == 0:
		return crcA ^ crcB
	case lenB == mapChunk:
		chunkShiftOnce.Do(func() {
			for i := range chunkShift {
				chunkShift[i] = shift(1<<i, mapChunk)
			}
		})
		return gf2Times(&chunkShift, crcA) ^ crcB
	}
	return shift(crcA, lenB) ^ crcB
}

// chunkShift is the matrix of shift(·, mapChunk): the images of the 32
// unit vectors.
var (
	chunkShift     [32]uint32
	chunkShiftOnce sync.Once
)

// shift multiplies crc by x^(8n) modulo the CRC-32 polynomial: the CRC of
// a message followed by n zero bytes, less the zeros' own CRC.
func shift(crcA uint32, lenB int64) uint32 {
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
	return crcA
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
