/* LD_PRELOAD shim for hosts without gdb: on SIGSEGV/SIGBUS/SIGABRT, print the faulting address, the
 * program counter's module and symbol, and the native backtrace with each frame's module offset (for
 * addr2line on another machine), flush stdio (so buffered output of the dying process is kept), then
 * die by the same signal. Built on the host by launch/deep_gemm_probe.sh:
 *   cc -shared -fPIC -O1 -o /tmp/segv_backtrace.so launch/segv_backtrace.c -ldl
 *   LD_PRELOAD=/tmp/segv_backtrace.so python3 ...   (without PYTHONFAULTHANDLER, which replaces it) */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <ucontext.h>
#include <unistd.h>

static void say_frame(const char *what, int i, void *pc) {
  Dl_info info;
  char buf[768];
  int n;
  if (dladdr(pc, &info) && info.dli_fname) {
    n = snprintf(buf, sizeof buf, "segv_backtrace: %s #%d %p %s +%#lx %s\n", what, i, pc, info.dli_fname,
                 (unsigned long)((char *)pc - (char *)info.dli_fbase), info.dli_sname ? info.dli_sname : "?");
  } else {
    n = snprintf(buf, sizeof buf, "segv_backtrace: %s #%d %p (no module)\n", what, i, pc);
  }
  if (n > 0) write(2, buf, n < (int)sizeof buf ? n : (int)sizeof buf - 1);
}

static void on_fault(int sig, siginfo_t *si, void *ctx) {
  ucontext_t *uc = (ucontext_t *)ctx;
  char buf[256];
  void *frames[64];
  int n, k, i;
  fflush(stdout);
  fflush(stderr);
  n = snprintf(buf, sizeof buf, "segv_backtrace: signal %d, fault address %p\n", sig, si->si_addr);
  if (n > 0) write(2, buf, n);
#if defined(__x86_64__)
  say_frame("pc", 0, (void *)uc->uc_mcontext.gregs[REG_RIP]);
#else
  (void)uc;
#endif
  k = backtrace(frames, 64);
  for (i = 0; i < k; i++) say_frame("frame", i, frames[i]);
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install(void) {
  static char alt_stack[1 << 16];
  stack_t ss;
  struct sigaction sa;
  void *warm[2];
  backtrace(warm, 2); /* loads libgcc_s now, not inside the handler */
  memset(&ss, 0, sizeof ss);
  ss.ss_sp = alt_stack;
  ss.ss_size = sizeof alt_stack;
  sigaltstack(&ss, 0);
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigaction(SIGSEGV, &sa, 0);
  sigaction(SIGBUS, &sa, 0);
  sigaction(SIGABRT, &sa, 0);
}
