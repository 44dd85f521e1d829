//! Charts (placeholder).
