#include "control/control_service.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "cuda/gpu_info.h"
#include "grpcpp/grpcpp.h"
#include "reduce/reduce.h"
#include "spdlog/spdlog.h"
#include "transport/ucx_transport.h"

namespace ciuic::daemon {

namespace {

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

void FillEntry(const config::TuningEntry& e, proto::TuneEntry* out) {
  out->set_key(e.key);
  out->set_value(e.value);
  out->set_description(e.description);
}

}  // namespace

absl::StatusOr<Caller> ControlService::CallerOf(const grpc::ServerContext* ctx) const {
  std::optional<Caller> caller;
  if (const ControlSocket* callers = callers_.load()) caller = callers->CallerOf(ctx->peer());
  if (!caller) {
    return absl::UnauthenticatedError(
        absl::StrCat("ciuicd cannot tell who is calling (peer ", ctx->peer(), ")"));
  }
  return *caller;
}

grpc::Status ControlService::JoinJob(grpc::ServerContext* ctx, const proto::JoinJobRequest* req,
                                     proto::JoinJobReply* reply) {
  auto caller = CallerOf(ctx);
  if (!caller.ok()) return ToGrpc(caller.status());
  JoinRequest r;
  r.caller_uid = caller->uid;
  r.session_token = req->session_token();
  r.job_id = req->job_id();
  r.rank = req->rank();
  r.world_size = req->world_size();
  r.local_rank = req->local_rank();
  r.local_size = req->local_size();
  r.coordinator = req->coordinator();
  uint64_t fast_path_bytes = 0;
  absl::Status s = engine_->Join(r, &fast_path_bytes);
  if (s.ok()) {
    reply->set_node_name(node_name_);
    reply->set_fast_path_bytes(fast_path_bytes);
    reply->set_op_timeout_ms(tuning_->Snapshot().op_timeout_ms);
  }
  return ToGrpc(s);
}

grpc::Status ControlService::GetStatus(grpc::ServerContext* ctx, const proto::StatusRequest*,
                                       proto::StatusReply* reply) {
  auto caller = CallerOf(ctx);
  if (!caller.ok()) return ToGrpc(caller.status());
  EngineStatus st = engine_->Status();
  reply->set_version(CIUIC_VERSION);
  reply->set_node_name(node_name_);
  reply->set_socket_path(socket_path_);
  reply->set_peer_address(peer_address_);
  reply->set_ordering_port(ordering_port_);
  reply->set_metrics_address(metrics_address_);
  reply->set_reduce_kernels(std::string(reduce::ActiveIsa()));
  reply->set_uptime_seconds(st.uptime_seconds);
  reply->set_worker_threads(st.worker_threads);
  reply->set_ops_completed(st.ops_completed);
  reply->set_ops_failed(st.ops_failed);
  reply->set_bytes_reduced(st.bytes);
  const GpuProbe& gpus = ProbeGpus();
  reply->set_cuda_built(gpus.built_with_cuda);
  for (const GpuDevice& d : gpus.devices) {
    proto::GpuInfo* g = reply->add_gpus();
    g->set_index(d.index);
    g->set_name(d.name);
    g->set_memory_bytes(d.memory_bytes);
    g->set_compute_major(d.compute_major);
    g->set_compute_minor(d.compute_minor);
  }
  reply->set_gpus_unavailable(gpus.unavailable);
  reply->set_ucx_cuda_memory(UcxTransport::SupportsCudaMemory());
  reply->set_gpu_mapped_allocations(st.gpu_mapped_allocations);
  reply->set_gpu_mapped_bytes(st.gpu_mapped_bytes);
  reply->set_gpu_pinned_host_bytes(st.gpu_pinned_bytes);
  uint32_t hidden_sessions = 0, hidden_jobs = 0;
  for (const auto& s : st.sessions) {
    if (!authorization_.Sees(*caller, s.uid)) {
      ++hidden_sessions;
      continue;
    }
    auto* out = reply->add_sessions();
    out->set_session_id(s.id);
    out->set_uid(s.uid);
    out->set_pid(s.pid);
    out->set_job_id(s.job_id);
    out->set_rank(s.rank);
    out->set_arena_bytes(s.arena_bytes);
  }
  for (const auto& j : st.jobs) {
    if (!authorization_.Sees(*caller, j.uid)) {
      ++hidden_jobs;
      continue;
    }
    auto* out = reply->add_jobs();
    out->set_job_id(j.id);
    out->set_uid(j.uid);
    out->set_world_size(j.world_size);
    out->set_local_size(j.local_size);
    for (int r : j.ranks) out->add_ranks(r);
    out->set_state(j.state);
    out->set_ops_completed(j.ops_completed);
    out->set_ops_failed(j.ops_failed);
    out->set_bytes_reduced(j.bytes);
    out->set_ops_compressed(j.ops_compressed);
    out->set_bytes_before_compression(j.bytes_before_compression);
    out->set_bytes_after_compression(j.bytes_after_compression);
    out->set_ops_fused(j.ops_fused);
    out->set_fused_runs(j.fused_runs);
    out->set_ops_staged(j.ops_staged);
    out->set_bytes_staged(j.bytes_staged);
    out->set_feedback_residuals(j.feedback_residuals);
    out->set_feedback_host_bytes(j.feedback_host_bytes);
    out->set_feedback_device_bytes(j.feedback_device_bytes);
    out->set_feedback_evictions(j.feedback_evictions);
    out->set_feedback_resets(j.feedback_resets);
    out->set_feedback_too_large(j.feedback_too_large);
    out->set_ops_direct(j.ops_direct);
    for (const auto& [rank, seconds] : j.rank_skew_seconds) {
      proto::RankSkew* skew = out->add_rank_skew();
      skew->set_rank(rank);
      skew->set_seconds(seconds);
    }
    for (const auto& p : j.pending) {
      auto* po = out->add_pending();
      po->set_name(p.name);
      po->set_collective(p.collective);
      po->set_bytes(p.bytes);
      for (int r : p.submitted) po->add_submitted_ranks(r);
      for (int r : p.waiting) po->add_waiting_for_ranks(r);
      po->set_age_seconds(p.age_seconds);
    }
  }
  reply->set_other_users_sessions(hidden_sessions);
  reply->set_other_users_jobs(hidden_jobs);
  return grpc::Status::OK;
}

grpc::Status ControlService::TuneGet(grpc::ServerContext*, const proto::TuneGetRequest* req,
                                     proto::TuneGetReply* reply) {
  auto entries = tuning_->Get(req->key());
  if (!entries.ok()) return ToGrpc(entries.status());
  for (const auto& e : *entries) FillEntry(e, reply->add_entries());
  return grpc::Status::OK;
}

grpc::Status ControlService::TuneSet(grpc::ServerContext* ctx, const proto::TuneSetRequest* req,
                                     proto::TuneSetReply* reply) {
  auto caller = CallerOf(ctx);
  if (!caller.ok()) return ToGrpc(caller.status());
  if (absl::Status allowed = authorization_.CheckAdmin(*caller, "tune set"); !allowed.ok()) {
    spdlog::warn("tuning refused: uid {} (pid {}) asked {} = {}", caller->uid, caller->pid,
                 req->key(), req->value());
    return ToGrpc(allowed);
  }
  absl::Status s = tuning_->Set(req->key(), req->value());
  if (!s.ok()) return ToGrpc(s);
  auto entries = tuning_->Get(req->key());
  if (!entries.ok()) return ToGrpc(entries.status());
  if (!entries->empty()) FillEntry(entries->front(), reply->mutable_entry());
  spdlog::info("tuning: uid {} (pid {}) set {} = {}", caller->uid, caller->pid, req->key(),
               reply->entry().value());
  return grpc::Status::OK;
}

grpc::Status ControlService::GetPeers(grpc::ServerContext* ctx, const proto::PeersRequest*,
                                      proto::PeersReply* reply) {
  auto caller = CallerOf(ctx);
  if (!caller.ok()) return ToGrpc(caller.status());
  EnginePeers peers = engine_->Peers();
  reply->set_peer_address(peer_address_);
  uint32_t hidden = 0;
  for (const auto& j : peers.jobs) {
    if (!authorization_.Sees(*caller, j.uid)) {
      ++hidden;
      continue;
    }
    auto* out = reply->add_jobs();
    out->set_job_id(j.id);
    out->set_uid(j.uid);
    out->set_coordinator(j.coordinator);
    out->set_state(j.state);
    for (const auto& p : j.peers) {
      auto* po = out->add_peers();
      po->set_node_name(p.node_name);
      for (int r : p.ranks) po->add_ranks(r);
      po->set_self(p.self);
      po->set_state(p.state);
      po->set_bytes_sent(p.bytes_sent);
      po->set_bytes_received(p.bytes_received);
      po->set_rack(p.rack);
      po->set_rate_bytes_per_second(p.rate_bytes_per_s);
    }
    for (const auto& c : j.channels) {
      auto* co = out->add_channels();
      co->set_device(c.device);
      co->set_rate_bytes_per_second(c.rate_bytes_per_s);
      co->set_share(c.share);
    }
  }
  reply->set_other_users_jobs(hidden);
  return grpc::Status::OK;
}

grpc::Status ControlService::GetTrace(grpc::ServerContext* ctx, const proto::TraceRequest* req,
                                      proto::TraceReply* reply) {
  auto caller = CallerOf(ctx);
  if (!caller.ok()) return ToGrpc(caller.status());
  std::optional<uid_t> owner;
  if (!authorization_.IsAdmin(*caller)) owner = caller->uid;
  EngineTrace trace = engine_->Trace(req->job_id(), req->last(), owner, req->in_flight());
  reply->set_now_us(trace.now_us);
  reply->set_capacity(trace.capacity);
  reply->set_recorded(trace.recorded);
  reply->set_other_users_ops(trace.other_users);
  for (const OpTraceRow& row : trace.ops) {
    proto::OpTrace* out = reply->add_ops();
    out->set_job_id(row.job_id);
    out->set_name(row.name);
    out->set_collective(row.collective);
    out->set_dtype(row.dtype);
    out->set_bytes(row.bytes);
    out->set_device(row.device);
    out->set_submitted_us(row.submitted_us);
    for (const auto& [rank, after] : row.arrivals) {
      proto::RankArrival* a = out->add_arrivals();
      a->set_rank(rank);
      a->set_after_us(after);
    }
    if (row.launched_us >= 0) out->set_launched_us(row.launched_us);
    if (row.ready_us >= 0) out->set_ready_us(row.ready_us);
    if (row.announced_us >= 0) out->set_announced_us(row.announced_us);
    if (row.run_start_us >= 0) out->set_run_start_us(row.run_start_us);
    if (row.run_end_us >= 0) out->set_run_end_us(row.run_end_us);
    out->set_last_node(row.last_node);
    out->set_ready_spread_us(row.ready_spread_us);
    out->set_queued_us(row.queued_us);
    out->set_run_seq(row.run_seq);
    out->set_fused_ops(row.fused_ops);
    out->set_direct(row.direct);
    out->set_codec(row.codec);
    out->set_algorithm(row.algorithm);
    out->set_model_flat_us(row.model_flat_us);
    out->set_model_rack_us(row.model_rack_us);
    out->set_done_us(row.done_us);
    out->set_code(row.code);
    out->set_error(row.error);
    out->set_job_seq(row.job_seq);
    out->set_count(row.count);
    out->set_world_size(row.world_size);
    out->set_timeout_ms(row.timeout_ms);
    out->set_state(row.state);
  }
  return grpc::Status::OK;
}

absl::StatusOr<std::unique_ptr<grpc::Server>> StartControlServer(grpc::Service* service) {
  grpc::ServerBuilder builder;
  builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server) return absl::UnavailableError("cannot start the control service (gRPC)");
  return server;
}

}  // namespace ciuic::daemon
