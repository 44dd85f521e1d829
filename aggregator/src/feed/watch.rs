//! The HTTP watch feed: `GET /v1/services/{name}/weights?watch=true` streams each new
//! weight set as a server-sent event whose id is the weight version.
//!
//! A watcher gets the current set at once, then one event per material change. It
//! never sees a half-applied cycle: each event is one service's whole set.

use crate::api::views::WeightSet;
use crate::state::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use futures_util::stream::{self, Stream};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

fn event(set: &WeightSet) -> Event {
    let data = serde_json::to_string(set).unwrap_or_else(|_| "{}".to_string());
    Event::default()
        .event("weights")
        .id(set.version.to_string())
        .data(data)
}

/// The event stream for one service, starting with `current`.
pub fn stream(
    state: Arc<State>,
    service: String,
    current: WeightSet,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let changes = state.changes.subscribe();
    let first = event(&current);
    let seed = (state, service, changes, current.version, Some(first));
    let events = stream::unfold(
        seed,
        |(state, service, mut changes, version, first)| async move {
            if let Some(ev) = first {
                return Some((Ok(ev), (state, service, changes, version, None)));
            }
            loop {
                // The sender lives as long as the daemon; its end ends the stream.
                changes.changed().await.ok()?;
                let set = {
                    let b = state.balancer();
                    // A service that expired while watched ends the stream.
                    WeightSet::of(b.service(&service)?)
                };
                if set.version != version {
                    let v = set.version;
                    return Some((Ok(event(&set)), (state, service, changes, v, None)));
                }
            }
        },
    );
    Sse::new(events).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
}
