//! The symmetry reduction (docs/model.md, "Keeping the state small"): the two agents are alike,
//! the two filters are alike, and the order in which streams and orphaned callouts sit in the
//! state is only their order of creation. States that differ by swapping the agents, swapping
//! the filters or reordering those lists have the same futures up to that renaming, and every
//! property quantifies over all agents and filters; the checker keeps one state of each class.

use crate::hash::hash;
use crate::world::State;

/// The class's representative: of the (up to) four renamings, each with its streams and orphans
/// in a canonical order, the one whose hash is least.
pub fn representative(s: &State) -> State {
    let swaps: &[bool] = if s.agents.len() == 2 { &[false, true] } else { &[false] };
    let mut best: Option<(u64, State)> = None;
    for &agents in swaps {
        for filters in [false, true] {
            let t = renamed(s, agents, filters);
            let k = hash(&t);
            if best.as_ref().is_none_or(|(b, _)| k < *b) {
                best = Some((k, t));
            }
        }
    }
    best.map_or_else(|| s.clone(), |(_, t)| t)
}

/// `s` with the agents and/or the filters swapped, its streams and orphans in canonical order.
pub fn renamed(s: &State, swap_agents: bool, swap_filters: bool) -> State {
    let mut t = s.clone();
    if swap_agents {
        t.agents.swap(0, 1);
    }
    if swap_filters {
        t.caches.swap(0, 1);
    }
    for st in &mut t.streams {
        if swap_agents {
            st.agent = 1 - st.agent;
        }
        if swap_filters {
            st.filter = 1 - st.filter;
        }
    }
    t.streams.sort_by_cached_key(hash);
    t.orphans.sort_by_cached_key(hash);
    t
}
