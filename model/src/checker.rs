//! The world as stateright sees it: its states and steps (`world`), judged by the properties
//! (`props`) and told as a trace (`report`). Its own module so that the world knows nothing of
//! what judges or tells it.

use stateright::Model;

use crate::world::{Action, State, World};

impl Model for World {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![self.initial()]
    }

    fn actions(&self, s: &State, out: &mut Vec<Action>) {
        self.enabled(s, s.faults < self.cfg.faults, true, out);
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        self.step(last, action)
    }

    fn properties(&self) -> Vec<stateright::Property<Self>> {
        crate::props::properties(&self.cfg)
    }

    fn format_step(&self, last: &State, action: Action) -> Option<String> {
        let next = self.step(last, action)?;
        Some(crate::report::describe(self, last, action, &next))
    }
}
