package kvindex

import "testing"

// keySlot is the Redis Cluster specification's CRC16 (XMODEM) modulo
// 16,384: its check value (CRC16 of "123456789" is 0x31C3) and slots
// CLUSTER KEYSLOT gives (the Redis documentation's "somekey" and
// "foo{hash_tag}" examples); slotTags has a tag for every slot.
func TestKeySlot(t *testing.T) {
	for _, c := range []struct {
		tag  string
		slot int
	}{{"123456789", 0x31C3 & 16383}, {"somekey", 11058}, {"hash_tag", 2515}, {"", 0}} {
		if got := keySlot(c.tag); got != c.slot {
			t.Errorf("keySlot(%q) = %d, want %d", c.tag, got, c.slot)
		}
	}
	for s, tag := range slotTags() {
		if tag == "" || keySlot(tag) != s {
			t.Fatalf("slot %d: tag %q hashes to %d", s, tag, keySlot(tag))
		}
	}
}
