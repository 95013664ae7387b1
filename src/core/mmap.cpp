#include "core/mmap.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <thread>
#include <vector>

#include "core/error.h"

namespace ds {

std::shared_ptr<MappedFile> MappedFile::open(const std::filesystem::path& path) {
  std::shared_ptr<MappedFile> f(new MappedFile());
  f->path_ = path.string();
  const int fd = ::open(f->path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(f->path_ + ": cannot open: " + std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    throw Error(f->path_ + ": cannot stat: " + std::strerror(e));
  }
  if (S_ISDIR(st.st_mode)) {
    ::close(fd);
    throw Error(f->path_ + ": is a directory, expected a file");
  }
  f->size_ = size_t(st.st_size);
  if (f->size_ > 0) {
    void* p = mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      const int e = errno;
      ::close(fd);
      throw Error(f->path_ + ": cannot mmap: " + std::strerror(e));
    }
    f->data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);
  return f;
}

MappedFile::~MappedFile() {
  if (data_) munmap(const_cast<uint8_t*>(data_), size_);
}

void MappedFile::prefetch(int threads, const std::function<void(size_t, size_t)>& progress) const {
  if (size_ == 0) return;
  madvise(const_cast<uint8_t*>(data_), size_, MADV_WILLNEED);
  constexpr size_t kChunk = size_t(16) << 20;
  const size_t chunks = (size_ + kChunk - 1) / kChunk;
  std::atomic<size_t> next{0}, done{0};
  std::atomic<uint64_t> sink{0};
  auto work = [&](bool report) {
    uint64_t acc = 0;
    for (size_t c; (c = next.fetch_add(1)) < chunks;) {
      const size_t end = std::min(size_, (c + 1) * kChunk);
      for (size_t o = c * kChunk; o < end; o += 4096) acc += data_[o];
      const size_t d = done.fetch_add(end - c * kChunk) + (end - c * kChunk);
      if (report && progress) progress(d, size_);
    }
    sink += acc;
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(work, false);
  work(true);
  for (auto& t : pool) t.join();
  if (progress) progress(size_, size_);
}

}  // namespace ds
