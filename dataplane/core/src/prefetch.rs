//! A cache hint: start loading the line that holds a value the next step is known to read, so
//! that the step finds it in cache instead of waiting on memory. It changes nothing a program can
//! observe — no value, no order, no determinism — only when a line arrives.
//!
//! The scheduler knows some of its next reads ahead: after a dispatch, the task that is now its
//! tenant's head. (Hinting the tenant the ring serves next as well made the 10k-tenant pair
//! ~10 % slower once the records were in line order — docs/benchmarks/journal.md — and was
//! removed.)

/// Hints that `value`'s first cache line will be read soon. A no-op off x86-64.
#[inline(always)]
pub(crate) fn prefetch<T>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    #[allow(unsafe_code)]
    // SAFETY: `prefetcht0` is a hint with no architectural effect: it never faults and reads
    // nothing into the program. The address comes from a live reference besides.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>((value as *const T).cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}
