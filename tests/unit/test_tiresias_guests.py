"""The guest/host map of GPU sharing under an allocation policy: both directions in step."""
import pytest

from tiresias.packing.guests import Guests


def test_pairs_unpair_and_reverse_lookup_stay_in_step():
    g = Guests()
    g[5] = 1
    g[6] = 2
    assert dict(g) == {5: 1, 6: 2} and g.guest_on(1) == 5 and g.guest_on(2) == 6
    g[5] = 3                                  # a guest moved to another host
    assert g.guest_on(1) is None and g.guest_on(3) == 5 and g[5] == 3
    assert g.pop(6) == 2 and g.guest_on(2) is None and 6 not in g
    assert g.pop(6) is None and g.pop(6, -1) == -1
    del g[5]
    assert len(g) == 0 and not g and g.guest_on(3) is None


def test_a_host_takes_one_guest():
    g = Guests()
    g[5] = 1
    with pytest.raises(ValueError, match="already hosts job 5"):
        g[6] = 1
    assert dict(g) == {5: 1} and g.guest_on(1) == 5
