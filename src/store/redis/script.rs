//! The limiter script: one Lua file per algorithm (each the twin of its Rust module under
//! `src/limiter`), a prelude of exact integer helpers, and the batch driver, joined into the one
//! script that runs per slot group.

pub const LIMITER_SCRIPT: &str = concat!(
    include_str!("lua/prelude.lua"),
    "\n",
    include_str!("lua/fixed_window.lua"),
    "\n",
    include_str!("lua/sliding_window.lua"),
    "\n",
    include_str!("lua/sliding_log.lua"),
    "\n",
    include_str!("lua/bucket.lua"),
    "\n",
    include_str!("lua/batch.lua"),
);
