//! Newtype identifiers and the two small enums every layer shares: lanes and priority bands.

use std::fmt;

use serde::{Deserialize, Serialize};

macro_rules! id {
    ($(#[$doc:meta])* $name:ident($inner:ty)) => {
        $(#[$doc])*
        #[derive(
            Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
        )]
        pub struct $name(pub $inner);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}", self.0)
            }
        }
    };
}

id!(
    /// A customer organisation; the unit of fairness.
    TenantId(u32)
);
id!(
    /// A user inside a tenant; the unit of per-user rate and running limits.
    UserId(u32)
);
id!(
    /// A task, unique per node deployment.
    TaskId(u64)
);
id!(
    /// One try of a task at a provider.
    AttemptId(u64)
);
id!(
    /// Monotonic per attempt; writers present it so a stale one changes nothing.
    FencingToken(u64)
);
id!(
    /// A row of the model capability matrix.
    ModelId(u16)
);
id!(
    /// A provider quota boundary: provider + account + region + model.
    ProviderId(u16)
);
id!(
    /// The policy a task was admitted under; tasks keep it for life.
    PolicyVersion(u64)
);

/// Service classes (design.md §4). Order is the index into per-lane arrays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Lane {
    EnterpriseReserved,
    PaidShared,
    Standard,
    BestEffort,
    Expensive,
    Recovery,
}

impl Lane {
    pub const COUNT: usize = 6;
    pub const ALL: [Lane; Lane::COUNT] = [
        Lane::EnterpriseReserved,
        Lane::PaidShared,
        Lane::Standard,
        Lane::BestEffort,
        Lane::Expensive,
        Lane::Recovery,
    ];

    pub fn index(self) -> usize {
        self as usize
    }

    pub fn name(self) -> &'static str {
        match self {
            Lane::EnterpriseReserved => "ENTERPRISE_RESERVED",
            Lane::PaidShared => "PAID_SHARED",
            Lane::Standard => "STANDARD",
            Lane::BestEffort => "BEST_EFFORT",
            Lane::Expensive => "EXPENSIVE",
            Lane::Recovery => "RECOVERY",
        }
    }
}

impl fmt::Display for Lane {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Priority bands inside a tenant: P0 (recovery, operator only) … P4 (best effort).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Band {
    P0,
    P1,
    P2,
    P3,
    P4,
}

impl Band {
    pub const COUNT: usize = 5;
    pub const ALL: [Band; Band::COUNT] = [Band::P0, Band::P1, Band::P2, Band::P3, Band::P4];

    pub fn index(self) -> usize {
        self as usize
    }

    pub fn from_index(index: usize) -> Band {
        Band::ALL[index]
    }

    /// The band after `steps` promotions of aging: never above P1, P0 stays P0.
    pub fn aged(self, steps: u64) -> Band {
        if self == Band::P0 {
            return Band::P0;
        }
        let promoted = (self.index() as u64)
            .saturating_sub(steps)
            .max(Band::P1.index() as u64);
        Band::from_index(promoted as usize)
    }
}

impl fmt::Display for Band {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "P{}", self.index())
    }
}
