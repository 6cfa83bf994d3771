package pth

import "github.com/abnconvert/abnconvert/negate"

// crc32Combine returns the CRC-32 (IEEE) of A followed by B from crcA,
// crcB and len(B), without reading either (negate.Combine). A copy that
// checks its input's CRC and computes its output's, where the two differ
// only in a few ranges, then reads each byte once.
func crc32Combine(crcA, crcB uint32, lenB int64) uint32 { return negate.Combine(crcA, crcB, lenB) }
