//! Resource units in fixed point: 1 unit = 1000 milli-units. Integer arithmetic keeps the core and
//! the simulator bit-for-bit deterministic across machines.

use std::fmt;

use serde::{Deserialize, Serialize};

pub const MILLI_PER_UNIT: u64 = 1000;

#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
pub struct Units(pub u64);

impl Units {
    pub const ZERO: Units = Units(0);

    pub fn whole(units: u64) -> Units {
        Units(units * MILLI_PER_UNIT)
    }

    pub fn milli(self) -> u64 {
        self.0
    }

    pub fn as_f64(self) -> f64 {
        self.0 as f64 / MILLI_PER_UNIT as f64
    }
}

impl fmt::Display for Units {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}.{:03}u",
            self.0 / MILLI_PER_UNIT,
            self.0 % MILLI_PER_UNIT
        )
    }
}
