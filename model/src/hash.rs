//! A fast, fixed-seed hash (the same in every run) for the model's own needs: choosing a
//! symmetry class's representative, ordering streams, and the memos of replays and settled
//! states. stateright fingerprints states with its own hasher.

use std::hash::{BuildHasher, Hash};

pub fn hash<T: Hash>(t: &T) -> u64 {
    foldhash::fast::FixedState::with_seed(0x1de7_a0de).hash_one(t)
}
