//! Sim-only fault injection endpoints for event streams: close all streams, leaderless cluster, reset the
//! event buffer (as after a snapshot restore).

use super::{json_response, ApiError, AppState};
use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::response::Response;
use serde_json::json;

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

/// `PUT /v1/sim/leader?leader=false|true[&timers_after=<secs>]`: an election after the server
/// that open event streams were bridged to went away: open streams close (`client/rpc.go`: the
/// bridge breaks), new ones are served (by a follower), other non-stale requests get 500 "No
/// cluster leader" until `leader=true` (see `api::no_leader_guard`). With `timers_after`, the
/// new leader serves requests before it has re-armed the lock TTL timers (`nomad/leader.go`
/// `establishLeadership` runs `restoreLockTTLTimers`, `nomad/locks.go`, among its other
/// steps): until then it holds no timer, so a renewal of a lock that is still held is answered
/// 409 (`RenewTTLTimer`: `errTimerNotFound`), and nothing expires.
pub async fn set_leader(
    State(st): State<AppState>,
    RawQuery(q): RawQuery,
) -> Result<Response, ApiError> {
    let q = q.unwrap_or_default();
    let leader = !q.contains("leader=false");
    let timers_after = q
        .split('&')
        .find_map(|kv| kv.strip_prefix("timers_after="))
        .map(|v| {
            v.parse::<u64>().map_err(|_| {
                ApiError(
                    StatusCode::BAD_REQUEST,
                    "timers_after: whole seconds".into(),
                )
            })
        })
        .transpose()?;
    st.server.write(|s| {
        if leader && s.leaderless {
            match timers_after {
                None => crate::locks::restore_timers(s),
                Some(_) => s.lock_timers = Default::default(),
            }
        }
        s.leaderless = !leader;
    });
    if let (true, Some(secs)) = (leader, timers_after) {
        let server = st.server.clone();
        tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_secs(secs)).await;
            server.write(crate::locks::restore_timers);
        });
    }
    if !leader {
        st.server.stream_close.send_modify(|g| *g += 1);
    }
    Ok(json_response(
        StatusCode::OK,
        st.server.index(),
        &json!({"Leader": leader}),
    ))
}
