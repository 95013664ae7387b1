#include <pthread.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <thread>

#include "cli/commands.h"
#include "core/error.h"
#include "core/log.h"
#include "server/server.h"

namespace ds {

int run_serve(const ServeOptions& o) {
  // SIGINT / SIGTERM are taken by one thread with sigwait, so they are blocked before any
  // other thread (engine, kernels, HTTP workers) starts and inherits the mask.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  std::signal(SIGPIPE, SIG_IGN);  // a client that hung up must not kill the server

  Session s = open_session(o.model, o.engine);
  ServerConfig cfg;
  cfg.host = o.host;
  cfg.port = o.port;
  cfg.api_key = o.api_key;
  cfg.http = o.http;
  cfg.io_threads = o.io_threads;
  cfg.max_waiting_requests = o.max_waiting_requests;
  cfg.model_name = o.served_model_name;
  if (cfg.model_name.empty()) cfg.model_name = std::filesystem::path(s.loaded.path).stem().string();
  ApiServer server(*s.engine, s.loaded, cfg);
  const int port = server.bind();
  std::fprintf(stderr, "deepserve: serving %s on http://%s:%d (KV cache %lld tokens)\n",
               cfg.model_name.c_str(), cfg.host.c_str(), port,
               static_cast<long long>(s.engine->kv_capacity_tokens()));
  std::fflush(stderr);

  std::atomic<bool> signalled{false};
  std::thread waiter([&] {
    int sig = 0;
    sigwait(&stop_signals, &sig);
    signalled = true;
    std::fprintf(stderr, "deepserve: %s: draining in-flight requests (up to %.0f s)\n",
                 sig == SIGINT ? "SIGINT" : "SIGTERM", o.drain_timeout_s);
    server.shutdown(o.drain_timeout_s);
  });
  const bool ok = server.run();
  if (!signalled) pthread_kill(waiter.native_handle(), SIGTERM);  // listener died: wake it
  waiter.join();
  if (!ok && !signalled) throw Error("the HTTP listener failed");
  std::fprintf(stderr, "deepserve: stopped\n");
  return 0;
}

}  // namespace ds
