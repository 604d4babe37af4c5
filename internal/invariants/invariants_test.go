package invariants

import "testing"

func TestAssertionFailedf(t *testing.T) {
	defer func() {
		r := recover()
		if Enabled && r == nil {
			t.Fatal("AssertionFailedf did not panic in an invariants build")
		}
		if !Enabled && r != nil {
			t.Fatalf("AssertionFailedf panicked without the invariants tag: %v", r)
		}
	}()
	AssertionFailedf("x=%d", 1)
}

func TestSometimes(t *testing.T) {
	hits := 0
	for i := 0; i < 1000; i++ {
		if Sometimes(50) {
			hits++
		}
	}
	if !Enabled && hits != 0 {
		t.Fatalf("Sometimes fired %d times without the invariants tag", hits)
	}
	if Enabled && (hits == 0 || hits == 1000) {
		t.Fatalf("Sometimes(50) fired %d of 1000 times", hits)
	}
}
