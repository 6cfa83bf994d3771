package failure

import (
	"errors"
	"fmt"
	"testing"
)

func TestOf(t *testing.T) {
	base := errors.New("x.pth: bad zip")
	tests := []struct {
		name string
		err  error
		want Kind
	}{
		{"nil", nil, OK},
		{"plain error is bad input", base, BadInput},
		{"unsupported", Unsupportedf("op %s", "Foo"), Unsupported},
		{"unsupported wrapped", fmt.Errorf("verify: %w", Unsupportedf("op Foo")), Unsupported},
		{"internal panic", Panic("pth", "index out of range"), Internal},
		{"outermost wins", As(BadInput, fmt.Errorf("ctx: %w", Internalf("bug"))), BadInput},
		{"mismatch", As(Mismatch, base), Mismatch},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := Of(tc.err); got != tc.want {
				t.Errorf("Of(%v) = %v, want %v", tc.err, got, tc.want)
			}
		})
	}
	if As(Internal, nil) != nil {
		t.Error("As(kind, nil) must stay nil")
	}
	if !errors.Is(fmt.Errorf("w: %w", As(Internal, base)), base) {
		t.Error("the class must keep the cause reachable with errors.Is")
	}
}
