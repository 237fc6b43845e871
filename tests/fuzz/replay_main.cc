// The fuzz targets without libFuzzer (any compiler, every build): runs a
// target's LLVMFuzzerTestOneInput on the files given (a directory: every
// file in it, the committed seeds and the inputs that once broke
// something), then on `--generate N` inputs made from them by a fixed
// pseudo-random mutation (seed `--seed S`), so the same N inputs every run.
// A broken property aborts; the input that broke it is written to
// `--crash-file` (default ./replay-crash) and the process dies with the
// signal, so ctest reports the failure. tools/fuzz.sh runs the same targets
// under libFuzzer with coverage guidance and sanitizers.
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

// The input being run, for the signal handler.
const std::vector<uint8_t>* g_current = nullptr;
char g_crash_file[512] = "replay-crash";
char g_current_name[512] = "";

void WriteString(int fd, const char* s) {
  ssize_t ignored = write(fd, s, std::strlen(s));
  (void)ignored;
}

void OnFatalSignal(int sig) {
  WriteString(2, "replay: the input that broke it: ");
  WriteString(2, g_current_name);
  if (g_current != nullptr) {
    const int fd = open(g_crash_file, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      ssize_t ignored = write(fd, g_current->data(), g_current->size());
      (void)ignored;
      close(fd);
      WriteString(2, ", saved as ");
      WriteString(2, g_crash_file);
    }
  }
  WriteString(2, "\n");
  signal(sig, SIG_DFL);
  raise(sig);
}

bool ReadFile(const std::string& path, std::vector<uint8_t>* out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  out->assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return true;
}

// Files named on the command line; a directory's files, sorted.
bool CollectFiles(const std::string& path, std::vector<std::string>* files) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) {
    std::fprintf(stderr, "replay: %s: %s\n", path.c_str(), std::strerror(errno));
    return false;
  }
  if (!S_ISDIR(st.st_mode)) {
    files->push_back(path);
    return true;
  }
  DIR* dir = opendir(path.c_str());
  if (dir == nullptr) {
    std::fprintf(stderr, "replay: %s: %s\n", path.c_str(), std::strerror(errno));
    return false;
  }
  std::vector<std::string> found;
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] == '.') continue;
    found.push_back(path + "/" + e->d_name);
  }
  closedir(dir);
  std::sort(found.begin(), found.end());
  files->insert(files->end(), found.begin(), found.end());
  return true;
}

// One mutation of `in`, libFuzzer's simplest kinds: change, insert or erase
// bytes, splice in another input's, or a fresh random input.
std::vector<uint8_t> Mutate(const std::vector<std::vector<uint8_t>>& pool, std::mt19937_64& rng,
                            size_t max_len) {
  std::vector<uint8_t> in;
  if (!pool.empty() && rng() % 8 != 0) in = pool[rng() % pool.size()];
  if (in.empty()) {
    in.resize(rng() % (max_len + 1));
    for (auto& b : in) b = static_cast<uint8_t>(rng());
    return in;
  }
  const int edits = 1 + static_cast<int>(rng() % 4);
  for (int i = 0; i < edits; ++i) {
    switch (rng() % 5) {
      case 0:  // change a byte
      case 1:
        if (!in.empty()) in[rng() % in.size()] = static_cast<uint8_t>(rng());
        break;
      case 2:  // insert bytes
        if (in.size() < max_len) {
          const size_t n = 1 + rng() % std::min<size_t>(16, max_len - in.size());
          std::vector<uint8_t> add(n);
          for (auto& b : add) b = static_cast<uint8_t>(rng());
          in.insert(in.begin() + static_cast<std::ptrdiff_t>(rng() % (in.size() + 1)), add.begin(),
                    add.end());
        }
        break;
      case 3:  // erase bytes
        if (!in.empty()) {
          const size_t at = rng() % in.size();
          const size_t n = 1 + rng() % std::min<size_t>(16, in.size() - at);
          in.erase(in.begin() + static_cast<std::ptrdiff_t>(at),
                   in.begin() + static_cast<std::ptrdiff_t>(at + n));
        }
        break;
      case 4: {  // splice: a piece of another input over this one's tail
        const auto& other = pool[rng() % pool.size()];
        if (!other.empty()) {
          const size_t from = rng() % other.size();
          const size_t at = rng() % (in.size() + 1);
          in.resize(at);
          in.insert(in.end(), other.begin() + static_cast<std::ptrdiff_t>(from), other.end());
          if (in.size() > max_len) in.resize(max_len);
        }
        break;
      }
    }
  }
  return in;
}

void Run(const std::vector<uint8_t>& input, const std::string& name) {
  g_current = &input;
  std::snprintf(g_current_name, sizeof(g_current_name), "%s", name.c_str());
  LLVMFuzzerTestOneInput(input.data(), input.size());
  g_current = nullptr;
}

}  // namespace

int main(int argc, char** argv) {
  size_t generate = 0;
  uint64_t seed = 1;
  size_t max_len = 4096;
  std::vector<std::string> files;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&](const char* flag) -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "replay: %s needs a value\n", flag);
        std::exit(2);
      }
      return argv[++i];
    };
    if (arg == "--generate") {
      generate = std::strtoull(value("--generate"), nullptr, 10);
    } else if (arg == "--seed") {
      seed = std::strtoull(value("--seed"), nullptr, 10);
    } else if (arg == "--max-len") {
      max_len = std::strtoull(value("--max-len"), nullptr, 10);
    } else if (arg == "--crash-file") {
      std::snprintf(g_crash_file, sizeof(g_crash_file), "%s", value("--crash-file"));
    } else if (arg.rfind("--", 0) == 0) {
      std::fprintf(stderr,
                   "replay: unknown option %s\nusage: %s [--generate N] [--seed S] "
                   "[--max-len BYTES] [--crash-file PATH] FILE|DIR...\n",
                   arg.c_str(), argv[0]);
      return 2;
    } else if (!CollectFiles(arg, &files)) {
      return 2;
    }
  }
  for (int sig : {SIGABRT, SIGSEGV, SIGBUS, SIGFPE, SIGILL}) signal(sig, OnFatalSignal);

  std::vector<std::vector<uint8_t>> pool;
  for (const std::string& f : files) {
    std::vector<uint8_t> input;
    if (!ReadFile(f, &input)) {
      std::fprintf(stderr, "replay: cannot read %s\n", f.c_str());
      return 2;
    }
    Run(input, f);
    pool.push_back(std::move(input));
  }
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i < generate; ++i) {
    const std::vector<uint8_t> input = Mutate(pool, rng, max_len);
    Run(input, "generated input " + std::to_string(i) + " (seed " + std::to_string(seed) + ")");
  }
  std::printf("replay: %zu files and %zu generated inputs, no property broken\n", files.size(),
              generate);
  return 0;
}
