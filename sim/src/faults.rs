//! Sim-only fault injection for event streams: close all streams, leaderless cluster, reset the
//! event buffer (as after a snapshot restore).

use crate::api::{json_response, ApiError, AppState};
use crate::store::Server;
use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::response::Response;
use serde_json::json;
use tokio::sync::watch;

/// Receiver that changes when streams must close.
pub fn close_receiver(server: &Server) -> watch::Receiver<u64> {
    server.stream_close.subscribe()
}

/// `PUT /v1/sim/events/close`: ends every open event stream.
pub async fn close_streams(State(st): State<AppState>) -> Result<Response, ApiError> {
    st.server.stream_close.send_modify(|g| *g += 1);
    Ok(json_response(
        StatusCode::OK,
        st.server.index(),
        &json!({"Closed": true}),
    ))
}

/// `PUT /v1/sim/events/reset`: drops the event buffer and closes streams (snapshot restore).
pub async fn reset_buffer(State(st): State<AppState>) -> Result<Response, ApiError> {
    st.server.write(|s| s.broker.reset());
    st.server.stream_close.send_modify(|g| *g += 1);
    Ok(json_response(
        StatusCode::OK,
        st.server.index(),
        &json!({"Reset": true}),
    ))
}

/// `PUT /v1/sim/leader?leader=false|true`: an election after the server that open event streams
/// were bridged to went away: open streams close (`client/rpc.go`: the bridge breaks), new ones
/// are served (by a follower), other non-stale requests get 500 "No cluster leader" until
/// `leader=true` (see `api::no_leader_guard`).
pub async fn set_leader(
    State(st): State<AppState>,
    RawQuery(q): RawQuery,
) -> Result<Response, ApiError> {
    let leader = !q.unwrap_or_default().contains("leader=false");
    st.server.write(|s| {
        if leader && s.leaderless {
            crate::locks::restore_timers(s);
        }
        s.leaderless = !leader;
    });
    if !leader {
        st.server.stream_close.send_modify(|g| *g += 1);
    }
    Ok(json_response(
        StatusCode::OK,
        st.server.index(),
        &json!({"Leader": leader}),
    ))
}
