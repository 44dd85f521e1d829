//! The CPU work of one request: a fixed number of rounds of a hash.

use std::hash::{DefaultHasher, Hash, Hasher};

/// Runs `rounds` rounds of SipHash, each over the previous round's output, so that the
/// compiler can neither skip nor vectorise them. Returns the last hash.
pub fn burn(rounds: u64, seed: u64) -> u64 {
    let mut x = seed;
    for i in 0..rounds {
        let mut h = DefaultHasher::new();
        (x, i).hash(&mut h);
        x = std::hint::black_box(h.finish());
    }
    x
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_change_the_result_and_are_deterministic() {
        assert_eq!(burn(100, 1), burn(100, 1));
        assert_ne!(burn(100, 1), burn(101, 1));
        assert_eq!(burn(0, 7), 7);
    }
}
